"""Adapters that put flux's ops where models already are. Each submodule imports its framework
only when imported itself, so ``import flux`` never needs them:

    flux.integrations.megatron   Megatron-core layers and a GPT layer spec on flux
    flux.integrations.compile    a torch.compile (Inductor post-grad) pass rewriting
                                 all_gather -> mm and mm -> reduce_scatter into flux ops
    flux.integrations.vllm       a vLLM plugin installing that rewrite as vLLM's custom pass
"""

_SUBMODULES = ("compile", "megatron", "vllm")


def __getattr__(name):
    # ``flux.integrations.compile`` works without importing it first (its framework is imported then).
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"flux.integrations.{name}")
    raise AttributeError(f"module 'flux.integrations' has no attribute {name!r}")
