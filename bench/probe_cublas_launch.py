"""How does cuBLAS launch its GEMM kernel on a given shape: grid, cluster, launch attributes and the
bytes of its parameters?

cuBLAS's kernel on AG 1024 x 4096 x 768 takes each cluster's tile from a byte table in its kernel
parameters, indexed by the cluster's launch index (docs/performance.md §9, "The coalescer merges loads
issued in step"): its host picks which cluster runs which tile. This probe reads that table. It captures
`torch.mm(a, w.t())` (a [M, K], w [N, K], as the fused kernels' baseline) into a CUDA graph, and reads
each kernel node back through the driver API: the kernel's name, grid, block, dynamic shared memory,
every launch attribute the node answers (cluster dimension, cluster scheduling policy, programmatic
serialization, ...) and its parameters, each as hex bytes with its offset (cuFuncGetParamInfo). The
parameter block starts at offset 0x210 of constant bank 0 on sm_90, so `c[0x0][0x240]` in the SASS is
byte 0x30 of the block. Nothing is timed.

    python bench/probe_cublas_launch.py [--shapes MxKxN,...] [--dtype bf16|fp16] [--out FILE]

No GPU: one line, exit 1.

JSON (--out): {"format": 1, "command", "commit", "device", "sm_count", "cuda_driver", "shapes": [{"shape",
"kernels": [{"name", "grid": [x, y, z], "block": [x, y, z], "shared_bytes", "attributes": {"<id>": hex
of the attribute value's first 16 bytes}, "cluster": [x, y, z] or null, "params": [{"offset", "size",
"hex"}], "pointers": {"<param offset>": "a" | "w" | "out"} (8-byte words equal to the tensors'
addresses, anywhere in the block)}]}]}.
"""
import argparse
import ctypes
import json
import shlex
import sys
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = "1024x4096x768,1024x8192x1280,1024x4096x1536,256x4096x3072,1024x4096x14336"
# CUlaunchAttributeID values a kernel node may answer (cuda.h): access policy window, cooperative,
# cluster dimension, cluster scheduling policy, programmatic stream serialization, priority, memory
# sync domain map and domain, preferred shared memory carveout and later ones.
ATTRIBUTES = range(1, 24)


class KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.POINTER(ctypes.c_void_p)), ("extra", ctypes.POINTER(ctypes.c_void_p)),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def _driver():
    cu = ctypes.CDLL("libcuda.so.1")
    for name, args in (("cuGraphGetNodes", [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]),
                       ("cuGraphNodeGetType", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]),
                       ("cuGraphKernelNodeGetParams_v2", [ctypes.c_void_p, ctypes.POINTER(KernelNodeParams)]),
                       ("cuGraphKernelNodeGetAttribute", [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]),
                       ("cuFuncGetName", [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p]),
                       ("cuFuncGetParamInfo", [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                                               ctypes.POINTER(ctypes.c_size_t)]),
                       ("cuKernelGetName", [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p]),
                       ("cuKernelGetParamInfo", [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                                                 ctypes.POINTER(ctypes.c_size_t)]),
                       ("cuDriverGetVersion", [ctypes.POINTER(ctypes.c_int)])):
        fn = getattr(cu, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = args, ctypes.c_int
    return cu


def _param_layout(cu, p: KernelNodeParams):
    """[(offset, size)] of the kernel's parameters, in order."""
    out = []
    handle, info = (p.func, cu.cuFuncGetParamInfo) if p.func else (p.kern, cu.cuKernelGetParamInfo)
    i = 0
    while True:
        off, size = ctypes.c_size_t(), ctypes.c_size_t()
        if info(handle, i, ctypes.byref(off), ctypes.byref(size)) != 0:
            return out
        out.append((off.value, size.value))
        i += 1


def _node(cu, node, tensors):
    p = KernelNodeParams()
    rc = cu.cuGraphKernelNodeGetParams_v2(node, ctypes.byref(p))
    if rc != 0:
        return {"error": f"cuGraphKernelNodeGetParams_v2 returned {rc}"}
    name = ctypes.c_char_p()
    if p.func:
        cu.cuFuncGetName(ctypes.byref(name), p.func)
    elif p.kern:
        cu.cuKernelGetName(ctypes.byref(name), p.kern)
    attrs, cluster = {}, None
    for a in ATTRIBUTES:
        buf = (ctypes.c_ubyte * 64)()
        if cu.cuGraphKernelNodeGetAttribute(node, a, buf) == 0:
            attrs[str(a)] = bytes(buf[:16]).hex()
            if a == 4:  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                cluster = list(ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint * 3)).contents)
    params, blob = [], bytearray()
    layout = _param_layout(cu, p)
    if p.kernelParams:
        for i, (off, size) in enumerate(layout):
            raw = ctypes.string_at(p.kernelParams[i], size)
            params.append({"offset": off, "size": size, "hex": raw.hex()})
            blob[len(blob):] = b"\0" * max(0, off + size - len(blob))
            blob[off:off + size] = raw
    elif p.extra:  # CU_LAUNCH_PARAM_BUFFER_POINTER (1), pointer, CU_LAUNCH_PARAM_BUFFER_SIZE (2), &size, END
        ptr, size, i = None, None, 0
        while p.extra[i]:
            key = p.extra[i]
            if key == 1:
                ptr = p.extra[i + 1]
            elif key == 2:
                size = ctypes.cast(p.extra[i + 1], ctypes.POINTER(ctypes.c_size_t)).contents.value
            i += 2
        if ptr and size:
            blob = bytearray(ctypes.string_at(ptr, size))
            params.append({"offset": 0, "size": size, "hex": blob.hex()})
    pointers = {}
    for off in range(0, len(blob) - 7, 8):
        word = int.from_bytes(blob[off:off + 8], "little")
        for label, addr in tensors.items():
            if word == addr:
                pointers[str(off)] = label
    return {"name": (name.value or b"").decode(), "grid": [p.gridDimX, p.gridDimY, p.gridDimZ],
            "block": [p.blockDimX, p.blockDimY, p.blockDimZ], "shared_bytes": p.sharedMemBytes,
            "attributes": attrs, "cluster": cluster, "params": params, "pointers": pointers}


def probe(shape: str, dtype, cu):
    import torch

    m, k, n = (int(v) for v in shape.split("x"))
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    for _ in range(3):
        torch.mm(a, w.t(), out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        torch.mm(a, w.t(), out=out)
    graph = ctypes.c_void_p(g.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    cu.cuGraphGetNodes(graph, None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    cu.cuGraphGetNodes(graph, nodes, ctypes.byref(count))
    tensors = {"a": a.data_ptr(), "w": w.data_ptr(), "out": out.data_ptr()}
    kernels = []
    for node in nodes:
        kind = ctypes.c_int(-1)
        cu.cuGraphNodeGetType(node, ctypes.byref(kind))
        if kind.value == 0:  # CU_GRAPH_NODE_TYPE_KERNEL
            kernels.append(_node(cu, node, tensors))
    del g
    return {"shape": shape, "kernels": kernels}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, help="MxKxN, comma-separated (a [M, K], w [N, K])")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("probe_cublas_launch: needs a CUDA GPU; nothing probed")
        return 1
    cu = _driver()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows = [probe(s, dtype, cu) for s in args.shapes.split(",")]
    for r in rows:
        for kern in r["kernels"]:
            print(r["shape"], kern.get("name"), kern.get("grid"), kern.get("cluster"), kern.get("block"),
                  kern.get("shared_bytes"), "params:", sum(q["size"] for q in kern.get("params", [])), "bytes")
    if args.out:
        sys.path.insert(0, HERE)
        from bench_fused_gemm import commit

        ver = ctypes.c_int(0)
        cu.cuDriverGetVersion(ctypes.byref(ver))
        cmd = "python " + " ".join(shlex.quote(x) for x in ["bench/probe_cublas_launch.py"] +
                                   list(argv if argv is not None else sys.argv[1:]))
        doc = {"format": 1, "command": cmd, "commit": commit(), "device": torch.cuda.get_device_name(),
               "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
               "cuda_driver": ver.value, "shapes": rows}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
