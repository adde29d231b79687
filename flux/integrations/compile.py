"""flux.integrations.compile: an Inductor post-grad pass that puts flux's ops where a compiled
graph gathers before a GEMM or reduce-scatters after one.

    import flux.integrations.compile as flux_compile

    flux_compile.enable()                      # or: with flux_compile.enabled(): ...
    model = torch.compile(model)
    loss = model(x).sum(); loss.backward()     # graphs are rewritten as Inductor compiles them
    flux_compile.stats()                       # {"ag_gemm": 2, "gemm_rs": 2, "skipped": 0}

Inductor reads the pass when it compiles a graph: the forward at the first call of the compiled
function, the backward at the first backward. Keep the pass enabled across both.

``wait(all_gather_into_tensor(x)) -> mm / addmm`` becomes ``flux.ag_gemm`` and ``mm ->
wait(reduce_scatter_tensor(sum))`` becomes ``flux.gemm_rs`` (the functional-collective form that
DTensor's sequence parallelism traces to), directly or through a reshape. What is rewritten and
what is left alone (each reason logged once on the ``flux`` logger, counted in
``stats()["skipped"]``): docs/integrations.md. The pass decides from the graph alone, so every
rank must compile the same graph (SPMD code does). It is installed as
``torch._inductor.config.post_grad_custom_post_pass`` (a ``CustomGraphPass`` where that class
exists, so that Inductor's graph cache keys on it); new nodes carry ``meta["eager_input_vals"]``
so that Inductor hands the flux ops contiguous inputs.
"""
import contextlib
import functools
import hashlib
import logging
import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree

__all__ = ["FluxCompilePass", "disable", "enable", "enabled", "is_enabled", "reset_stats", "rewrite", "stats"]

log = logging.getLogger("flux")
aten = torch.ops.aten

# Reshapes between an N-D activation ([s, b, h]) and the GEMM's 2-D rows.
_VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)

_STATS = {"ag_gemm": 0, "gemm_rs": 0, "skipped": 0}
_LOGGED = set()


def stats() -> Dict[str, int]:
    """Rewrites made in this process since the last ``reset_stats()``: ``ag_gemm`` and ``gemm_rs``
    (fused ops inserted) and ``skipped`` (candidates left unchanged, each with a logged reason).
    A graph that Inductor loads from its cache was rewritten when it was first compiled and
    counts nothing here."""
    return dict(_STATS)


def reset_stats() -> None:
    for k in _STATS:
        _STATS[k] = 0


# --------------------------------------------------------------------------------------
# Graph helpers


def _c10d():
    return torch.ops._c10d_functional


def _val(node: Any) -> Optional[torch.Tensor]:
    """The fake tensor an FX node carries (``meta["val"]``), or None (a graph without
    Inductor's metadata is left alone)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("val")
    return v if isinstance(v, FakeTensor) else None


def _static(x) -> bool:
    return isinstance(x, int)


def _known_true(cond) -> bool:
    """True only when ``cond`` (a bool or a SymBool) holds for every value of its symbols."""
    if isinstance(cond, bool):
        return cond
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(cond))
    except Exception:  # noqa: BLE001  (unknown: treat as not known)
        return False


def _known_contiguous(t: torch.Tensor) -> bool:
    """Row-major contiguous for all values of any symbolic sizes (never guards)."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if not _known_true(size == 1) and not _known_true(stride == expected):
            return False
        expected = expected * size
    return True


def _is_transpose_2d(node: fx.Node) -> bool:
    v = _val(node.args[0]) if node.op == "call_function" and node.args else None
    if v is None or v.dim() != 2:
        return False
    if node.target is aten.t.default:
        return True
    if node.target is aten.permute.default:
        return list(node.args[1]) == [1, 0]
    if node.target is aten.transpose.int:
        return sorted(d % 2 for d in node.args[1:3]) == [0, 1]
    return False


def _weight_of(b: fx.Node) -> Optional[Tuple[fx.Node, str]]:
    """(weight, layout) for the GEMM operand ``b`` [K, N]: the deepest tensor of a chain of 2-D
    transposes above ``b`` that is contiguous, with "nk" where an odd number of transposes
    separates it from ``b``; None if no tensor of the chain is contiguous."""
    chain: List[Tuple[fx.Node, bool]] = [(b, False)]
    node, flipped = b, False
    while isinstance(node, fx.Node) and _is_transpose_2d(node) and isinstance(node.args[0], fx.Node):
        node, flipped = node.args[0], not flipped
        chain.append((node, flipped))
    for node, flipped in reversed(chain):
        v = _val(node)
        if v is not None and v.dim() == 2 and _known_contiguous(v):
            return node, ("nk" if flipped else "kn")
    return None


def _ancestors(nodes) -> set:
    seen, todo = set(), [n for n in nodes if isinstance(n, fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _group_name_of(arg) -> Optional[str]:
    """The c10d name in a collective's group argument (a name, or a ProcessGroup where the
    schema takes one)."""
    if isinstance(arg, str):
        return arg
    name = getattr(arg, "group_name", None)
    return name if isinstance(name, str) else None


def _group_problem(group_arg, group_size, device: torch.device) -> Optional[str]:
    """Why flux cannot run on this collective's group, or None."""
    from flux.runtime.groups import group_device, group_from_name

    name = _group_name_of(group_arg)
    if name is None:
        return f"the collective's group argument {group_arg!r} is not a process-group name"
    try:
        group = group_from_name(name)
        world = dist.get_world_size(group)
    except Exception as e:  # noqa: BLE001  (a group flux cannot resolve is simply not rewritten)
        return f"process group {name!r} cannot be resolved ({type(e).__name__}: {e})"
    if world < 2:
        return f"process group {name!r} has one rank"
    if group_size != world:
        return f"the collective's group size {group_size} differs from the size {world} of group {name!r}"
    if group_device(group).type != device.type:
        return (f"process group {name!r} communicates {group_device(group).type} tensors but the GEMM runs on "
                f"{device.type}")
    return None


def _dtype_problem(*vals: Optional[torch.Tensor]) -> Optional[str]:
    from flux.ops._common import SUPPORTED_DTYPES

    dtypes = {v.dtype for v in vals if v is not None}
    if len(dtypes) != 1:
        return f"operands of different dtypes {sorted(str(d) for d in dtypes)}"
    dt = next(iter(dtypes))
    if dt not in SUPPORTED_DTYPES:
        return f"dtype {dt} (flux takes {', '.join(str(d) for d in SUPPORTED_DTYPES)})"
    devices = {(v.device.type, v.device.index) for v in vals if v is not None}
    if len(devices) != 1:
        return "operands on different devices"
    return None


def _gemm_operands(mm: fx.Node):
    """(bias or None, A, B) of an mm or addmm node, or a reason it cannot be fused."""
    if mm.target is aten.mm.default:
        return None, mm.args[0], mm.args[1]
    beta, alpha = _arg(mm, 3, "beta", 1), _arg(mm, 4, "alpha", 1)
    if beta != 1 or alpha != 1:
        return f"addmm with beta={beta}, alpha={alpha}"
    return mm.args[0], mm.args[1], mm.args[2]


def _skip(reason: str) -> bool:
    """Count a candidate left unchanged and log its reason once per process."""
    _STATS["skipped"] += 1
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        log.warning("flux.integrations.compile: left unchanged: %s", reason)
    return False


def _fake(target, args):
    """(value, fake args) of ``target`` run on the fake tensors of ``args`` (nodes stand for
    their ``meta["val"]``): the metadata of the node it becomes. Every rewrite computes these
    before it changes the graph, so that a failure leaves the graph as it was."""
    from torch._guards import detect_fake_mode

    fargs = fx.node.map_arg(args, lambda n: n.meta.get("val"))
    mode = detect_fake_mode([x for x in pytree.tree_leaves(fargs) if isinstance(x, torch.Tensor)])
    if mode is None:
        raise RuntimeError("no fake tensor mode for the new node's metadata")
    with mode:
        return target(*fargs), fargs


def _node(graph: fx.Graph, target, args, val, fargs=None) -> fx.Node:
    """A new call_function node with its fake value. ``fargs`` given (the flux ops): Inductor
    hands the op its inputs with exactly the strides of these fake arguments (contiguous here,
    as flux requires); a node inserted by a pass carries no such constraint otherwise."""
    node = graph.call_function(target, args)
    node.meta["val"] = val
    if fargs is not None:
        node.meta["eager_input_vals"] = (tuple(fargs), {})
    return node


def _getitem(graph: fx.Graph, node: fx.Node, i: int) -> fx.Node:
    return _node(graph, operator.getitem, (node, i), node.meta["val"][i])


def _alive(n) -> bool:
    return isinstance(n, fx.Node) and not getattr(n, "_erased", False)


def _erase_if_unused(graph: fx.Graph, nodes) -> None:
    for n in nodes:
        if _alive(n) and n.graph is graph and not n.users and n.op == "call_function":
            graph.erase_node(n)


def _transposes_above(node: fx.Node, base: fx.Node) -> List[fx.Node]:
    """The transposes from ``node`` up to ``base`` (to erase once unused), nearest first."""
    out = []
    while node is not base and isinstance(node, fx.Node) and _is_transpose_2d(node):
        out.append(node)
        node = node.args[0]
    return out


# --------------------------------------------------------------------------------------
# all_gather -> GEMM


def _ag_candidates(wait: fx.Node, gathered: torch.Tensor):
    """(mm, view or None) for every mm/addmm whose A operand is the gathered tensor, directly
    (2-D) or through one reshape to [rows, K] (any reshape of the contiguous gathered tensor to
    [rows, K] keeps its rows in rank order, as ag_gemm's output has them)."""
    out = []
    for user in wait.users:
        if user.target in (aten.mm.default, aten.addmm.default):
            a = user.args[0] if user.target is aten.mm.default else user.args[1]
            if a is wait and gathered.dim() == 2:
                out.append((user, None))
        elif user.target in _VIEWS:
            v = _val(user)
            if v is None or v.dim() != 2 or not _known_true(v.shape[-1] == gathered.shape[-1]):
                continue
            for mm in user.users:
                if mm.target in (aten.mm.default, aten.addmm.default):
                    a = mm.args[0] if mm.target is aten.mm.default else mm.args[1]
                    if a is user:
                        out.append((mm, user))
    return out


def _check_ag_candidate(mm: fx.Node, shard_val: torch.Tensor, ag: fx.Node, wait: fx.Node):
    """(weight, layout, bias, N) of a fusible GEMM after the gather, or the reason it is not."""
    ops = _gemm_operands(mm)
    if isinstance(ops, str):
        return ops
    bias, _, b = ops
    if not isinstance(b, fx.Node) or _val(b) is None:
        return "the GEMM's B operand has no tensor metadata"
    n = _val(b).shape[-1]
    if not _static(n):
        return "a GEMM with a dynamic N"
    wl = _weight_of(b)
    if wl is None:
        return "the GEMM's weight operand is contiguous in neither layout ([N, K] nor [K, N])"
    weight, layout = wl
    out_val = _val(mm)
    bias_val = _val(bias) if bias is not None else None
    if bias is not None:
        if bias_val is None or tuple(bias_val.shape) != (n,) or not _known_contiguous(bias_val):
            return "an addmm whose bias is not a contiguous [N] vector"
    problem = _dtype_problem(shard_val, _val(weight), out_val, bias_val)
    if problem:
        return problem
    if not _known_contiguous(shard_val):
        return "the gathered shard is not contiguous"
    if {ag, wait} & _ancestors([weight, bias]):
        return "the GEMM's weight or bias is computed from the gathered tensor"
    return weight, layout, bias, n


def _rewrite_all_gather(graph: fx.Graph, ag: fx.Node) -> bool:
    c10d = _c10d()
    shard = ag.args[0]
    group_size, group_arg = _arg(ag, 1, "group_size"), _arg(ag, 2, "group_name")
    waits = [u for u in ag.users if u.target is c10d.wait_tensor.default]
    shard_val = _val(shard)
    if len(waits) != 1 or shard_val is None or shard_val.dim() < 2 or _val(waits[0]) is None:
        log.debug("flux.integrations.compile: an all-gather without one wait or without metadata")
        return False
    wait = waits[0]
    gathered = _val(wait)
    cands = _ag_candidates(wait, gathered)
    if not cands:
        log.debug("flux.integrations.compile: no GEMM reads the gathered tensor %s", wait.name)
        return False
    if not _static(gathered.shape[-1]):
        return _skip("all-gather -> GEMM with a dynamic K")
    problem = _group_problem(group_arg, group_size, shard_val.device)
    if problem:
        return _skip(f"all-gather -> GEMM: {problem}")
    checked, reasons = [], []
    for mm, view in cands:
        r = _check_ag_candidate(mm, shard_val, ag, wait)
        (reasons if isinstance(r, str) else checked).append(r if isinstance(r, str) else (mm, view) + r)
    if not checked:
        return _skip(f"all-gather -> GEMM: {reasons[0]}")
    # The GEMM with the largest N hides the gather best; other GEMMs read the gathered tensor.
    mm, view, weight, layout, bias, n = max(checked, key=lambda c: c[5])

    # Readers of the gather other than this GEMM: sizes of its leading dimensions (dynamic
    # shapes) read them from ag_gemm's output, which has the same; anything else reads the
    # gathered tensor that ag_gemm returns.
    sizes_of = [u for u in ag.users if u is not wait and u.target is aten.sym_size.int
                and 0 <= u.args[1] % gathered.dim() < gathered.dim() - 1]
    others = [u for u in ag.users if u is not wait and u not in sizes_of]
    path = {mm} if view is None else ({view} if set(view.users) == {mm} else set())
    keep = bool(others) or any(u not in path for u in wait.users)

    # Where the fused op goes: after the gather and the weight and bias if every reader of the
    # gather comes later (nothing moves); otherwise in the gather's place, with the ancestors of
    # the weight and bias that come after the gather moved before it.
    order = {node: i for i, node in enumerate(graph.nodes)}
    anchor = max([ag] + [x for x in (weight, bias) if isinstance(x, fx.Node)], key=order.__getitem__)
    readers = list(wait.users) + others + sizes_of
    to_move = []
    if any(order[r] <= order[anchor] for r in readers):
        anchor = None
        to_move = sorted((x for x in _ancestors([weight, bias]) if x.op == "call_function" and order[x] > order[ag]),
                         key=order.__getitem__)
        if any(x.is_impure() for x in to_move):
            return _skip("all-gather -> GEMM: the weight is computed after the gather is read, by a node with "
                         "side effects")
    name = _group_name_of(group_arg)
    fused_args = (shard, weight, bias, name, layout, None, keep)
    sizes = None
    try:
        fused_val, fused_fargs = _fake(torch.ops.flux.ag_gemm.default, fused_args)
        if view is not None:
            mm_val = _val(mm)
            if all(_static(s) for s in mm_val.shape):
                sizes = list(mm_val.shape)
            else:  # the view's own size arguments (symbolic nodes defined before it), last one N
                sizes = list(view.args[1])[:-1] + [n]
            res_val, _ = _fake(aten.reshape.default, (fused_val[0], sizes))
    except Exception as e:  # noqa: BLE001  (the graph is unchanged so far)
        return _skip(f"all-gather -> GEMM: the fused op's metadata failed ({type(e).__name__}: {e})")

    with graph.inserting_before(anchor.next if anchor is not None else ag):  # (in creation order)
        fused = _node(graph, torch.ops.flux.ag_gemm.default, fused_args, fused_val, fused_fargs)
        out = _getitem(graph, fused, 0)
        new_gathered = _getitem(graph, fused, 1) if keep else None
    for x in to_move:
        fused.prepend(x)
    for u in sizes_of:
        u.replace_input_with(ag, out)
    if view is None:
        res = out
    else:
        with graph.inserting_before(mm):
            res = _node(graph, aten.reshape.default, (out, sizes), res_val)
    mm.replace_all_uses_with(res)
    graph.erase_node(mm)
    b_node = mm.args[2] if mm.target is aten.addmm.default else mm.args[1]
    _erase_if_unused(graph, [view] + _transposes_above(b_node, weight))
    if keep:
        wait.replace_all_uses_with(new_gathered)
        for u in others:
            u.replace_input_with(ag, new_gathered)
    _erase_if_unused(graph, [wait, ag])
    _STATS["ag_gemm"] += 1
    return True


# --------------------------------------------------------------------------------------
# GEMM -> reduce_scatter


def _rewrite_reduce_scatter(graph: fx.Graph, rs: fx.Node) -> bool:
    c10d = _c10d()
    inp = rs.args[0]
    reduce_op = _arg(rs, 1, "reduce_op")
    group_size, group_arg = _arg(rs, 2, "group_size"), _arg(rs, 3, "group_name")
    if not isinstance(inp, fx.Node):
        return False
    view, mm = None, inp
    if inp.target in _VIEWS and isinstance(inp.args[0], fx.Node):
        view, mm = inp, inp.args[0]
    if mm.target not in (aten.mm.default, aten.addmm.default):
        log.debug("flux.integrations.compile: no GEMM produces the reduce-scattered tensor %s", inp.name)
        return False
    waits = [u for u in rs.users if u.target is c10d.wait_tensor.default]
    if len(waits) != 1 or _val(waits[0]) is None or _val(mm) is None:
        return _skip("GEMM -> reduce-scatter without one wait or without metadata")
    wait = waits[0]
    if reduce_op != "sum":
        return _skip(f"GEMM -> reduce-scatter with reduction {reduce_op!r} (flux sums)")
    if mm.target is aten.addmm.default:
        return _skip("GEMM -> reduce-scatter with the bias inside the GEMM (addmm): the reduce-scatter would sum "
                     "it over the ranks, so it is not flux's bias added once")
    a, b = mm.args[0], mm.args[1]
    mm_val, a_val = _val(mm), _val(a)
    if a_val is None or _val(b) is None:
        return _skip("GEMM -> reduce-scatter: operands without tensor metadata")
    n = mm_val.shape[-1]
    if not _static(n) or not _static(a_val.shape[-1]):
        return _skip("GEMM -> reduce-scatter with a dynamic K or N")
    if view is not None:
        v = _val(view)
        if v is None or v.dim() < 1 or not _static(v.shape[-1]) or v.shape[-1] != n:
            return _skip("GEMM -> reshape -> reduce-scatter where the reshape changes the last dimension")
        if list(view.users) != [rs]:
            return _skip("GEMM -> reduce-scatter: the reshaped GEMM result is also used elsewhere")
    if list(mm.users) != [view or rs]:
        return _skip("GEMM -> reduce-scatter: the GEMM result is also used elsewhere")
    if not _known_contiguous(a_val):
        return _skip("GEMM -> reduce-scatter: the GEMM's A operand is not contiguous")
    wl = _weight_of(b)
    if wl is None:
        return _skip("GEMM -> reduce-scatter: the weight operand is contiguous in neither layout ([N, K] nor [K, N])")
    weight, layout = wl
    problem = _dtype_problem(a_val, _val(weight), mm_val) or _group_problem(group_arg, group_size, a_val.device)
    if problem:
        return _skip(f"GEMM -> reduce-scatter: {problem}")
    order = {node: i for i, node in enumerate(graph.nodes)}
    others = [u for u in rs.users if u is not wait]
    if any(order[u] < order[wait] for u in others):
        return _skip("GEMM -> reduce-scatter: the un-waited reduce-scatter is read before its wait")

    out_val = _val(wait)
    sizes = None
    if out_val.dim() != 2:
        if all(_static(s) for s in out_val.shape):
            sizes = list(out_val.shape)
        else:  # the view's size arguments with the scattered dimension inferred
            sizes = list(view.args[1])
            if any(s == -1 for s in sizes[1:]):
                return _skip("GEMM -> reduce-scatter: a dynamic reshape flux cannot restate")
            sizes[0] = -1
    name = _group_name_of(group_arg)
    fused_args = (a, weight, None, name, layout, None)
    try:
        fused_val, fused_fargs = _fake(torch.ops.flux.gemm_rs.default, fused_args)
        res_val = _fake(aten.reshape.default, (fused_val, sizes))[0] if sizes is not None else None
    except Exception as e:  # noqa: BLE001  (the graph is unchanged so far)
        return _skip(f"GEMM -> reduce-scatter: the fused op's metadata failed ({type(e).__name__}: {e})")
    with graph.inserting_before(rs):
        res = _node(graph, torch.ops.flux.gemm_rs.default, fused_args, fused_val, fused_fargs)
        if sizes is not None:
            res = _node(graph, aten.reshape.default, (res, sizes), res_val)
    wait.replace_all_uses_with(res)
    for u in others:  # e.g. the output node, where the result is saved for backward
        u.replace_input_with(rs, res)
    _erase_if_unused(graph, [wait, rs, view, mm] + _transposes_above(b, weight))
    _STATS["gemm_rs"] += 1
    return True


# --------------------------------------------------------------------------------------
# The pass


def rewrite(graph: fx.Graph) -> int:
    """Rewrite the all-gather -> GEMM and GEMM -> reduce-scatter patterns of a post-grad ATen FX
    graph into flux ops, in place; returns the number of ops inserted."""
    c10d = _c10d()
    done = 0
    for node in [n for n in graph.nodes if n.target is c10d.all_gather_into_tensor.default]:
        if _alive(node):
            done += _rewrite_all_gather(graph, node)
    for node in [n for n in graph.nodes if n.target is c10d.reduce_scatter_tensor.default]:
        if _alive(node):
            done += _rewrite_reduce_scatter(graph, node)
    if done:
        graph.lint()
    return done


try:  # Inductor's interface for a pass that its graph cache can key on (uuid)
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
except ImportError:  # an older torch: a plain callable, which bypasses the graph cache
    _PassBase = object


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class FluxCompilePass(_PassBase):
    """The post-grad pass: runs the pass installed before it (if any), then ``rewrite``.
    ``uuid`` names this file's contents and torch's version (and the earlier pass's uuid), so a
    cached graph is reused only when it was compiled by the same pass."""

    def __init__(self, previous=None):
        self.previous = previous
        self.active = True

    def __call__(self, graph: fx.Graph) -> None:
        if self.previous is not None:
            self.previous(graph)
        if self.active:
            rewrite(graph)

    def uuid(self) -> Optional[Any]:
        prev = None
        if self.previous is not None:
            prev_uuid = getattr(self.previous, "uuid", None)
            if prev_uuid is None:
                return None  # a plain callable before us: nothing to key a cache on
            prev = prev_uuid()
            if prev is None:
                return None
        return ("flux.integrations.compile", _source_hash(), torch.__version__, self.active, prev)


def _config():
    import torch._inductor.config as inductor_config

    return inductor_config


_installed: Optional[FluxCompilePass] = None  # the pass enable() made, wherever it sits now


def is_enabled() -> bool:
    """Whether graphs compiled from now on are rewritten."""
    return _installed is not None and _installed.active


def enable() -> None:
    """Install the pass as Inductor's ``post_grad_custom_post_pass`` (after any pass already
    there, which keeps running). Graphs compiled from now on are rewritten."""
    global _installed
    cfg = _config()
    current = cfg.post_grad_custom_post_pass
    if isinstance(current, FluxCompilePass):
        current.active = True
        _installed = current
        return
    _installed = FluxCompilePass(current)
    cfg.post_grad_custom_post_pass = _installed


def disable() -> None:
    """Remove the pass, restoring the pass that was there before ``enable`` (where something else
    has wrapped it since, it stays in place but rewrites nothing). Graphs compiled already keep
    their flux ops; graphs compiled from now on are left unchanged."""
    global _installed
    cfg = _config()
    if _installed is not None:
        _installed.active = False
        if cfg.post_grad_custom_post_pass is _installed:
            cfg.post_grad_custom_post_pass = _installed.previous
        _installed = None


@contextlib.contextmanager
def enabled():
    """``enable()`` for the duration of a ``with`` block (the first forward and backward calls of
    the compiled function, when Inductor compiles, must be inside it)."""
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()
