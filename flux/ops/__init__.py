"""One module per op family: schema (torch.library), fake implementation, the unfused
reference, and the choice among strategies."""
from flux.ops._checks import FluxInputError
from flux.ops.ag_gemm import ag_gemm, ag_gemm_ref
from flux.ops.gemm_rs import gemm_rs, gemm_rs_ref

__all__ = ["FluxInputError", "ag_gemm", "ag_gemm_ref", "gemm_rs", "gemm_rs_ref"]
