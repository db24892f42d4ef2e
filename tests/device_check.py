"""Device-placement checks on a CPU-only machine: modules on a simulated accelerator, values still real.

Moving modules to PyTorch's `meta` device catches a CPU tensor meeting them, but meta tensors hold no values,
so the first op that reads one (`.item()`, `.tolist()`, `bool(mask.all())`, HF `generate`) stops the call
and hides whatever comes after it. Here a module's parameters and buffers stay CPU tensors but become
instances of a marker subclass that reports `ACCELERATOR` as its device. A `TorchFunctionMode` sees every
torch call: results of ops on marked tensors are marked, `.to(ACCELERATOR)` / `device=ACCELERATOR` produce
marked tensors, `.cpu()` / `.to("cpu")` unmarked ones, and an op that mixes a marked tensor with an unmarked
one raises the error CUDA raises ("Expected all tensors to be on the same device"). The rules CUDA relaxes are
relaxed here too: 0-dim CPU tensors act as scalars, a device tensor may be indexed by CPU indices, `copy_`
crosses devices, `.item()` / `.tolist()` read values; `.numpy()` of a device tensor fails as on CUDA.

    with simulated_accelerator(reader, corrector):
        out = reader(**batch)        # raises on any CPU/accelerator mix, computes real values otherwise
    assert on_accelerator(out.logits)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map_only

ACCELERATOR = torch.device("cuda", 0)
HOST = torch.device("cpu")


class _OnAccelerator(torch.Tensor):
    """A CPU tensor that stands for one on ACCELERATOR."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Outside `simulated_accelerator` too (a result handed back to a test) it acts as a device tensor.
        with torch._C.DisableTorchFunctionSubclass():
            return _dispatch(func, args, kwargs or {})


def on_accelerator(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is (simulated to be) on ACCELERATOR."""
    return isinstance(tensor, _OnAccelerator)


def _mark(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if on_accelerator(tensor) else tensor.as_subclass(_OnAccelerator)


def _unmark(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(torch.Tensor) if on_accelerator(tensor) else tensor


def _is_accelerator(device) -> bool:
    if device is None:
        return False
    device = torch.device(device)
    return device.type == ACCELERATOR.type


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _mix_error(func) -> RuntimeError:
    # Worded as CUDA words it, so a test's `match=` means the same on a real GPU.
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {ACCELERATOR} and "
        f"cpu! (simulated accelerator, in {_name(func)})"
    )


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _check_same_device(func, tensors: list[torch.Tensor]) -> bool:
    """True when the op runs on ACCELERATOR; raises when marked and (non-scalar) unmarked tensors meet."""
    marked = [t for t in tensors if on_accelerator(t)]
    if not marked:
        return False
    # CUDA accepts 0-dim CPU tensors next to device tensors (they are read as scalars).
    if any(t.device == HOST and t.dim() > 0 for t in tensors if not on_accelerator(t)):
        raise _mix_error(func)
    return True


class _DeviceMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Ops below run on the CPU tensors underneath, without re-entering _OnAccelerator's handler.
        with torch._C.DisableTorchFunctionSubclass():
            return _dispatch(func, args, kwargs or {})


def _dispatch(func, args, kwargs):
    """Run `func` on the CPU, apply CUDA's device rules to its tensors and mark what lands on ACCELERATOR."""
    if func == torch.Tensor.device.__get__:
        return ACCELERATOR if on_accelerator(args[0]) else func(*args)
    if func == torch.Tensor.is_cuda.__get__:
        return on_accelerator(args[0]) or func(*args)
    if func == torch.Tensor.is_cpu.__get__:
        return not on_accelerator(args[0]) and func(*args)
    if func is torch.Tensor.get_device:
        return ACCELERATOR.index if on_accelerator(args[0]) else func(*args)
    if func in (torch.Tensor.numpy, torch.Tensor.__array__) and on_accelerator(args[0]):
        raise TypeError(
            f"can't convert {ACCELERATOR} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
            "to host memory first. (simulated accelerator)"
        )
    if func is torch.Tensor.to:
        return _to(args[0], *args[1:], **kwargs)
    if func is torch.Tensor.cpu:
        return _unmark(args[0]).to(HOST, copy=on_accelerator(args[0]))
    if func is torch.Tensor.cuda:
        return args[0] if on_accelerator(args[0]) else _mark(args[0].clone())
    if func is torch.Tensor.copy_:
        # copy_ crosses devices; the destination keeps its own.
        return func(*args, **kwargs)
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
        return _indexing(func, args, kwargs)

    device = kwargs.get("device")
    if device is not None:
        # A factory or `new_*` call names its device: that decides where the result lives.
        if not _is_accelerator(device):
            _check_same_device(func, _tensors((args, kwargs)))
            return func(*args, **kwargs)
        kwargs = {**kwargs, "device": HOST}
        return tree_map_only(torch.Tensor, _mark, func(*args, **kwargs))
    out = func(*args, **kwargs)
    if _check_same_device(func, _tensors((args, kwargs))):
        out = tree_map_only(torch.Tensor, _mark, out)
    return out


def _to(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        other, rest = args[0], args[1:]
        target = ACCELERATOR if on_accelerator(other) else other.device
        return _to(tensor, target, other.dtype, *rest, **kwargs)
    copy = bool(kwargs.pop("copy", False))  # _parse_to refuses it
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    dtype = dtype or tensor.dtype
    if device is not None and not _is_accelerator(device) and device.type != HOST.type:
        return _unmark(tensor).to(device=device, dtype=dtype, non_blocking=non_blocking, copy=copy)
    to_accelerator = on_accelerator(tensor) if device is None else _is_accelerator(device)
    # A real move between devices always copies; an alias would hide writes through the "other" copy.
    crosses = to_accelerator != on_accelerator(tensor)
    moved = _unmark(tensor).to(device=HOST, dtype=dtype, non_blocking=non_blocking, copy=copy or crosses)
    return _mark(moved) if to_accelerator else moved


def _indexing(func, args, kwargs):
    tensor, index = args[0], args[1]
    index_tensors = _tensors(index)
    if not on_accelerator(tensor) and any(on_accelerator(i) for i in index_tensors):
        raise RuntimeError(
            f"indices should be either on cpu or on the same device as the indexed tensor (cpu) "
            f"(simulated accelerator, in {_name(func)})"
        )
    if func is torch.Tensor.__setitem__:
        value = args[2]
        if (
            isinstance(value, torch.Tensor)
            and value.dim() > 0
            and on_accelerator(value) != on_accelerator(tensor)
        ):
            raise _mix_error(func)
        return func(*args, **kwargs)
    out = func(*args, **kwargs)
    return _mark(out) if on_accelerator(tensor) else out


@contextlib.contextmanager
def simulated_accelerator(*modules: nn.Module) -> Iterator[None]:
    """Put `modules` on the simulated ACCELERATOR and check every torch op inside the block.

    Parameters stay shared with the originals (a tied embedding stays tied) and are put back on exit.
    """
    restore: list[tuple[dict, str, torch.Tensor]] = []
    marked: dict[int, torch.Tensor] = {}
    for module in modules:
        for sub in module.modules():
            for store in (sub._parameters, sub._buffers):
                for name, tensor in store.items():
                    if tensor is None or on_accelerator(tensor):
                        continue
                    if id(tensor) not in marked:
                        if isinstance(tensor, nn.Parameter):
                            param = torch.Tensor._make_subclass(
                                _OnAccelerator, tensor.detach(), tensor.requires_grad
                            )
                            param._is_param = True  # isinstance(param, nn.Parameter) holds
                            marked[id(tensor)] = param
                        else:
                            marked[id(tensor)] = tensor.as_subclass(_OnAccelerator)
                    restore.append((store, name, tensor))
                    store[name] = marked[id(tensor)]
    try:
        with _DeviceMode():
            yield
    finally:
        for store, name, tensor in reversed(restore):
            store[name] = tensor
