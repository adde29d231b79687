"""One helper that defines a flux op from its pieces: ``define_op``.

From a forward, a fake and the gradients it builds the dispatcher-visible custom op
(torch.compile, fake tensors, tensor subclasses), its ``out=`` variant, the fake
implementations, the autograd formula and the eager autograd.Function (which skips the
dispatcher's Python custom-op layer, ~0.1 ms of host time a call). The forward's type
annotations are the schema; its group argument is the group's name in the op and may be the
group itself on the eager path (``resolve``).
"""
import dataclasses
from typing import Callable, Optional

import torch


@dataclasses.dataclass(frozen=True)
class OpParts:
    op: object  # torch.ops.flux.<name>
    out_op: Optional[object]  # torch.ops.flux.<name>_out: writes ``out``, no autograd
    function: type  # the eager torch.autograd.Function


def define_op(name: str, forward: Callable, fake: Callable, *, save: Callable, backward: Callable,
              out_forward: Optional[Callable] = None, out_fake: Optional[Callable] = None) -> OpParts:
    """Define ``flux::<name>`` (and ``flux::<name>_out`` where ``out_forward`` is given).

    forward(*args) -> outputs      annotated; the op's implementation
    fake(*args) -> outputs         shapes only (meta/fake tensors)
    save(ctx, args, outputs)       what backward needs (ctx.save_for_backward, attributes)
    backward(ctx, *grads) -> one gradient (or None) per argument
    out_forward(*args, out) -> None, out_fake(*args, out) -> None: the out= variant
    """
    op = torch.library.custom_op(f"flux::{name}", mutates_args=())(forward)
    op.register_fake(fake)
    torch.library.register_autograd(f"flux::{name}", backward, setup_context=save)
    out_op = None
    if out_forward is not None:
        out_op = torch.library.custom_op(f"flux::{name}_out", mutates_args=("out",))(out_forward)
        out_op.register_fake(out_fake)

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            ctx.eager = True  # backward may use eager collectives (the op's own formula traces them)
            ctx.set_materialize_grads(False)  # outputs the caller drops get no gradient (no collective)
            outputs = forward(*args)
            save(ctx, args, outputs)
            return outputs

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    Function.__name__ = Function.__qualname__ = "".join(w.capitalize() for w in name.split("_")) + "Function"
    return OpParts(op, out_op, Function)
