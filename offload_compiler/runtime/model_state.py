"""Model state in host memory: one :class:`ParamSlot` per offloaded parameter.

A slot holds the parameter's **master copy** in host memory (a block of a trinity host pool, so
the device-memory accounting counts it as host memory; pinned on CUDA) and, with
``offload="all"``, its **host gradient** accumulator. The parameter object itself is never
replaced (its identity, ``requires_grad`` and registration in the module stay as they are); only
its storage is resized: ``untyped_storage().resize_(0)`` frees the device memory and every view
of the parameter (saved views included) stays valid, pointing at the same storage, which
:meth:`ParamSlot.fetch` re-allocates and fills from the master copy.

State machine of one slot (``resident`` is "the device storage is allocated and current, or
being made current by a fetch copy in flight"):

* ``fetch()``: wait for a pending optimizer update of this parameter; if not resident, allocate
  the storage and copy master -> device. A no-op when resident.
* ``release(write_back)``: if resident: with ``write_back`` copy device -> master first (the
  device copy was the current one, e.g. a user optimizer stepped it), then free the storage.
* ``add_grad(g)``: copy (first micro-step after ``zero_grad``) or add ``g`` into the host
  gradient.

Inside a compiled graph (the ``trinity::param_*`` ops) these take the graph's
:class:`~offload_compiler.runtime.transfer.TransferRuntime` and copy **asynchronously** on its
copy streams (on the CPU: synchronously, or deferred under fault injection); the graph orders
them explicitly:

* ``fetch(runtime)`` issues the H2D copy (after the compute stream's work so far) and returns;
  ``fetch_wait(runtime)`` (``trinity::param_fetch_wait``, before the first reader) makes the
  compute stream wait for it.
* ``release(write_back, runtime)`` issues the D2H write-back and makes the compute stream wait
  for it before the storage is freed: non-blocking for the host, but the copy is exposed on the
  device (the free is ordered after it without ``record_stream``).
* ``add_grad(g, runtime)`` issues the D2H copy of ``g`` into the host gradient, or, when
  accumulating (or when ``g``'s layout differs), into a staging block of the runtime's pool whose
  add into the host gradient runs on the host later; ``trinity::grad_to_host_wait`` (which keeps
  ``g`` alive up to there) makes the compute stream wait for the copy before ``g`` is freed.

Host-side hazards are the slot's: the copies in flight are remembered as handles (CUDA events;
the deferred copies under fault injection) whose ``synchronize()`` is the host-side wait.
:meth:`ParamSlot.sync_master_copies` waits for the copies that read or write the master (before
the CPU optimizer writes it or the host reads it), :meth:`ParamSlot.finish_grad` for the gradient
copy, adding a staged gradient (before anything reads or writes the host gradient on the host).

The slot is found from the graph through an integer id (:func:`get_slot`, a weak registry), and
from the parameter through the attribute ``_trinity_slot`` (:func:`slot_of`), so it lives exactly
as long as the parameter or the compiled code that uses it; there is no module-level state other
than that registry.

Between steps, with ``offload="all"``, a parameter holds no device storage. What reads it then:

* ``state_dict()`` / ``load_state_dict()`` of a module that owns offloaded parameters work on
  their own: the backend installs :func:`install_module_hooks` on every such module it can find
  from the compiled frame (:func:`install_state_dict_hooks` does it by hand for any module).
* an eager forward of such a module raises ``RuntimeError`` naming the parameter (the forward
  pre-hook of :func:`install_module_hooks`); inside :func:`materialized` it runs normally.
* any other read of the tensor (``print(p)``, ``p.sum()``, ``copy.deepcopy``): where torch has
  ``torch._C._set_storage_data_ptr_access_error_msg`` (CUDA builds), the released storage is
  marked so that any access to its data raises ``RuntimeError`` with the same message; without it
  (CPU builds of torch) the storage is simply empty and such a read is undefined (README, "Limits
  today").

With ``offload="all"`` the parameter's owner is the :class:`~.cpu_optim.CPUOptimizer` given the
parameter (attribute ``_trinity_optimizer``, a weak reference): it is told of every gradient that
reaches the host (:meth:`ParamSlot.add_grad`), and :meth:`ParamSlot.check_owner` refuses the next
forward when gradients reached the host but no ``CPUOptimizer`` owns the parameter (a plain
``torch.optim`` optimizer would see ``p.grad is None`` and silently update nothing).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator

import torch

from .pool import HostPool
from .transfer import flat_bytes

__all__ = [
    "ParamSlot",
    "get_slot",
    "slot_of",
    "ensure_slot",
    "materialized",
    "install_state_dict_hooks",
    "install_module_hooks",
    "SLOT_ATTR",
    "OWNER_ATTR",
    "ON_DEVICE_ATTR",
]

SLOT_ATTR = "_trinity_slot"
OWNER_ATTR = "_trinity_optimizer"  # on the parameter: weakref.ref to the CPUOptimizer that owns it
# On a parameter that the plan keeps resident on the device with its gradient and optimizer state
# (option optimizer_on_device): it has no slot, and CPUOptimizer updates it on the device.
ON_DEVICE_ATTR = "_trinity_on_device"

# Where torch has them (CUDA builds), these make any access to a released storage's data raise
# RuntimeError with our message instead of reading freed memory (the mechanism cudagraph trees
# use for overwritten outputs). Feature-detected: the CPU build of torch 2.13 has neither.
_MARK_RELEASED = getattr(torch._C, "_set_storage_data_ptr_access_error_msg", None)
_UNMARK_RELEASED = getattr(torch._C, "_clear_storage_data_ptr_access_error_msg", None)
if _MARK_RELEASED is None or _UNMARK_RELEASED is None:
    _MARK_RELEASED = _UNMARK_RELEASED = None

_ids = itertools.count(1)
_registry: weakref.WeakValueDictionary[int, ParamSlot] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


def fetch_key(slot_id: int) -> tuple:
    """The transfer runtime's pending-copy key of a parameter's fetch copy (a tuple: never equal
    to an activation copy's integer key)."""
    return ("param", slot_id)


def grad_key(slot_id: int) -> tuple:
    """The transfer runtime's pending-copy key of a parameter's gradient copy."""
    return ("grad", slot_id)


def write_back_key(slot_id: int) -> tuple:
    """The transfer runtime's pending-copy key of a parameter's write-back copy."""
    return ("write_back", slot_id)


def _flat(storage: torch.UntypedStorage, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the first ``nbytes`` of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))


class ParamSlot:
    """Host-side state of one parameter (see the module docstring).

    Args:
        param: the parameter (any device); its storage must be allocated (its current value is
            copied into the master).
        pool: the host pool the master and the host gradient come from.
        keep_resident: ``True`` for ``offload="activations+params"``: the device copy is the
            current one at step boundaries (the user's own optimizer steps it).

    Raises:
        offload_compiler.runtime.pool.HostPoolExhausted: when the pool cannot hold the master.
    """

    def __init__(self, param: torch.nn.Parameter, pool: HostPool, keep_resident: bool):
        storage = param.untyped_storage()
        self.nbytes = storage.nbytes()
        if self.nbytes == 0 and param.numel() > 0:
            raise ValueError("trinity: a parameter with no allocated storage cannot get a host master copy")
        self.device = param.device
        self.pool = pool
        self.keep_resident = keep_resident
        self.param_ref = weakref.ref(param)
        # The master spans the whole storage (bytes), so views at any offset map 1:1.
        self._master_bytes = pool.empty_strided((self.nbytes,), (1,), torch.uint8)
        self._master_bytes.copy_(_flat(storage, self.nbytes, self.device))
        # The same bytes as a tensor shaped like the parameter (for the optimizer's host copy).
        self.master = torch.empty(0, dtype=param.dtype).set_(
            self._master_bytes.untyped_storage(), param.storage_offset(), tuple(param.shape), tuple(param.stride())
        )
        self.grad: torch.Tensor | None = None  # host gradient (offload="all"), allocated by enable_host_grad
        self.grad_valid = False  # False after zero_grad: the next add_grad copies
        self.num_grads = 0  # gradients accumulated since zero_grad (micro-steps)
        # Set by DDP's hook (grad_sync.idle_comm_hook) when it averaged an uncompiled backward's
        # bucket with the host gradient in it: the next device .grad handed over replaces it.
        self.handover_replaces = False
        self.name: str | None = None  # the parameter's name in its model, when the backend found it
        self.resident = True
        self.ready = threading.Event()  # cleared while an optimizer update of the master is pending
        self.ready.set()
        self.error: BaseException | None = None
        self.num_fetches = 0
        self.num_releases = 0
        self.num_write_backs = 0
        # Device copies issued by a compiled graph (handles: CUDA events, or deferred copies under
        # fault injection; synchronize() is the host-side wait). See the module docstring.
        self.h2d = None  # the latest copy reading the master (a fetch)
        self.d2h = None  # the latest copy writing the master (a write-back)
        self.unwaited_fetch: tuple | None = None  # (handle, keep-alive) of a fetch not yet waited for
        self._grad_copy: tuple | None = None  # (handle, staging block or None, "add" | "copy" | None)
        self.lock = threading.Lock()
        with _registry_lock:
            self.id = next(_ids)
            _registry[self.id] = self

    # ------------------------------------------------------------------ host bytes
    @property
    def master_bytes(self) -> torch.Tensor:
        """The master copy as bytes: a 1-D ``uint8`` host tensor over the whole storage
        (``nbytes`` long; :attr:`master` is a view of it shaped like the parameter)."""
        return self._master_bytes

    @property
    def host_bytes(self) -> int:
        """Host bytes this slot holds (master plus host gradient)."""
        return self.nbytes + (self.grad.untyped_storage().nbytes() if self.grad is not None else 0)

    def enable_host_grad(self) -> None:
        """Allocate the host gradient (same shape, stride and dtype as the parameter)."""
        if self.grad is None:
            p = self.master
            self.grad = self.pool.empty_strided(tuple(p.shape), tuple(p.stride()), p.dtype)
            self.grad_valid = False

    # ------------------------------------------------------------------ transitions
    def _param(self) -> torch.nn.Parameter:
        p = self.param_ref()
        if p is None:
            raise RuntimeError(f"trinity: the parameter of slot {self.id} no longer exists")
        return p

    def label(self) -> str:
        """``'gpt.tok.weight'`` (when known) and the shape and dtype, for messages."""
        p = self.master
        what = f"shape {list(p.shape)}, {p.dtype}"
        return f"parameter {self.name!r} ({what})" if self.name else f"a parameter ({what})"

    def released_message(self) -> str:
        """What a read of the released parameter is told (see the module docstring)."""
        if self.keep_resident:
            where = (
                "is offloaded to host memory (offload='activations+params') and was released inside the "
                "training step (after its last forward reader, until the backward fetches it again)"
            )
        else:
            where = (
                "is offloaded to host memory (offload='all') and holds no device memory between steps "
                "(its value is the host master copy)"
            )
        return (
            f"trinity: {self.label()} {where}. Read it through the compiled model or inside "
            "`with offload_compiler.materialized(model.parameters()):`; model.state_dict() and "
            "model.load_state_dict() work directly."
        )

    def owner(self):
        """The live :class:`~.cpu_optim.CPUOptimizer` that owns this parameter, or ``None``."""
        p = self.param_ref()
        ref = getattr(p, OWNER_ATTR, None) if p is not None else None
        return ref() if ref is not None else None

    def check_owner(self) -> None:
        """Refuse to go on when gradients reached the host but no ``CPUOptimizer`` owns the
        parameter (called by ``trinity::param_fetch``, i.e. at the next forward).

        Raises:
            RuntimeError: naming the parameter, when it has a host gradient since the last
                ``zero_grad`` and no live ``CPUOptimizer`` was given it.
        """
        if self.grad is None or not self.grad_valid or self.owner() is not None:
            return
        raise RuntimeError(
            f"trinity: gradients of {self.label()} reached host memory (offload='all'), but no "
            "offload_compiler.CPUOptimizer owns this parameter: with offload='all' p.grad stays None, so a "
            "torch.optim optimizer updates nothing. Use offload_compiler.CPUOptimizer(model.parameters(), "
            "torch.optim.AdamW, lr=...) (it steps the host copies), or offload='activations+params' to keep "
            "your own optimizer."
        )

    def wait_ready(self) -> None:
        """Block until no optimizer update of the master is pending; re-raise its error."""
        self.ready.wait()
        if self.error is not None:
            raise RuntimeError(f"trinity: the CPU optimizer failed updating slot {self.id}") from self.error

    def fetch(self, runtime=None) -> None:
        """Make the device storage hold the current value (see the module docstring).

        Args:
            runtime: the compiled graph's ``TransferRuntime`` (``trinity::param_fetch``): the
                copy is issued on its H2D copy stream under :func:`fetch_key` and
                waited for by :meth:`fetch_wait`. ``None`` (``materialized``, the state-dict
                hooks): the copy is done when this returns.
        """
        self.wait_ready()
        with self.lock:
            if self.resident:
                if self.unwaited_fetch is not None:
                    # A fetch whose wait never ran (an exception in between): this fetch's wait
                    # (or, without a runtime, this call) waits for it.
                    if runtime is not None:
                        runtime.adopt(fetch_key(self.id), *self.unwaited_fetch)
                    else:
                        _device_wait(self.unwaited_fetch[0], self.device)
                        self.unwaited_fetch = None
                return
            storage = self._param().untyped_storage()
            if _UNMARK_RELEASED is not None:
                _UNMARK_RELEASED(storage._cdata)
            storage.resize_(self.nbytes)  # allocated on the compute stream
            dst = _flat(storage, self.nbytes, self.device)
            if runtime is None:
                dst.copy_(self._master_bytes)
            else:
                handle = runtime.copy_async(fetch_key(self.id), self._master_bytes, dst, "h2d")
                if handle is not None:
                    self.h2d = handle
                    self.unwaited_fetch = (handle, (self._master_bytes.untyped_storage(), storage))
            self.resident = True
            self.num_fetches += 1

    def fetch_wait(self, runtime) -> None:
        """The compute stream waits for this slot's fetch copy issued through ``runtime`` (a
        no-op when the fetch issued nothing); non-blocking for the host."""
        runtime.wait_key(fetch_key(self.id))
        self.unwaited_fetch = None

    def release(self, write_back: bool, runtime=None) -> None:
        """Free the device storage; with ``write_back`` copy it into the master first.

        Args:
            write_back: copy device -> master before freeing.
            runtime: the compiled graph's ``TransferRuntime`` (``trinity::param_release``): the
                write-back runs on its D2H copy stream and the compute stream waits for it before
                the free (exposed on the device, non-blocking for the host). ``None``: synchronous.
        """
        with self.lock:
            if not self.resident:
                return
            if self.unwaited_fetch is not None:
                # Never in a verified graph (the wait comes first); the storage must not be freed
                # while a copy still writes it.
                _device_wait(self.unwaited_fetch[0], self.device)
                self.unwaited_fetch = None
            storage = self._param().untyped_storage()
            if write_back:
                src = _flat(storage, self.nbytes, self.device)
                if runtime is None:
                    self._master_bytes.copy_(src)
                else:
                    handle = runtime.copy_async(write_back_key(self.id), src, self._master_bytes, "d2h")
                    runtime.wait_key(write_back_key(self.id))  # the free below is ordered after the copy
                    if handle is not None:
                        self.d2h = handle
                self.num_write_backs += 1
            storage.resize_(0)
            if _MARK_RELEASED is not None:
                _MARK_RELEASED(storage._cdata, self.released_message())
            self.resident = False
            self.num_releases += 1

    def add_grad(self, g: torch.Tensor, runtime=None, replace: bool = False) -> None:
        """Accumulate the device gradient ``g`` (same shape as the parameter) into the host one,
        then tell the owning ``CPUOptimizer`` (if any) that it arrived.

        Args:
            g: the gradient.
            runtime: the compiled graph's ``TransferRuntime`` (``trinity::grad_to_host``): the
                copy is issued on its D2H copy stream under :func:`grad_key`, into
                the host gradient (first micro-step after ``zero_grad``, same layout) or into a
                staging block of the runtime's pool that :meth:`finish_grad` adds (or copies) into
                the host gradient; ``g`` must stay alive until ``trinity::grad_to_host_wait``.
                ``None``: synchronous.
            replace: ``g`` already includes the host gradient (DDP averaged the two, see
                :func:`materialized`): it replaces the host gradient instead of adding to it
                (synchronous only).

        Raises:
            RuntimeError: when the slot has no host gradient, when a pending update failed, or
                from the owner (``CPUOptimizer(overlap="backward")`` seeing more backwards than
                ``accumulation_steps``).
        """
        if self.grad is None:
            raise RuntimeError(f"trinity: slot {self.id} has no host gradient (offload='all' allocates it)")
        self.wait_ready()
        if replace and runtime is not None and runtime.async_copies:
            raise ValueError("ParamSlot.add_grad: replace=True is synchronous only (runtime=None)")
        if runtime is None or not runtime.async_copies:
            if replace:
                self.grad.copy_(g)
                self.num_grads = self.num_grads + 1 if self.grad_valid else 1
                self.grad_valid = True
            elif self.grad_valid:
                self.grad.add_(g.to(self.grad.device))
                self.num_grads += 1
            else:
                self.grad.copy_(g)
                self.grad_valid = True
                self.num_grads = 1
        else:
            self.finish_grad()  # the previous micro-step's gradient first: adds stay in order
            runtime.reap_staged()  # other staged gradients whose copies are done
            accumulate = self.grad_valid
            same_layout = (
                tuple(g.shape) == tuple(self.grad.shape)
                and tuple(g.stride()) == tuple(self.grad.stride())
                and g.dtype == self.grad.dtype
            )
            staging = runtime.staging(g) if accumulate or not same_layout else None
            dst = self.grad if staging is None else staging
            handle = runtime.copy_async(grad_key(self.id), flat_bytes(g), flat_bytes(dst), "d2h", host_block=staging)
            mode = "add" if accumulate else ("copy" if staging is not None else None)
            with self.lock:
                self._grad_copy = (handle, staging, mode)
            if staging is not None:
                runtime.note_staged(self)
            self.num_grads = self.num_grads + 1 if accumulate else 1
            self.grad_valid = True
        owner = self.owner()
        if owner is not None:
            owner._grad_arrived(self)  # counts backwards; overlap="backward" may start an update

    def finish_grad(self, block: bool = True) -> bool:
        """Complete the gradient copy in flight, if any: wait for it on the host and, when it
        went to a staging block, add (or copy) that into the host gradient. Call it before the
        host reads or writes the host gradient (the CPU optimizer, ``host_grads``, clipping,
        ``zero_grad``). Thread-safe.

        Args:
            block: ``False``: only if the copy has completed already (never waits).

        Returns:
            Whether no gradient copy is pending any more.
        """
        with self.lock:
            pending = self._grad_copy
            if pending is None:
                return True
            handle, staging, mode = pending
            if handle is not None:
                if not block and not handle.query():
                    return False
                handle.synchronize()
            if mode == "add":
                self.grad.add_(staging)
            elif mode == "copy":
                self.grad.copy_(staging)
            self._grad_copy = None
            return True

    def sync_master_copies(self) -> None:
        """Block until the device copies issued so far that read the master (fetches) or write
        it (write-backs) are done: before the host writes the master (the CPU optimizer's
        update) or reads it (``state_dict``)."""
        for handle in (self.h2d, self.d2h):
            if handle is not None:
                handle.synchronize()


def _device_wait(handle, device: torch.device) -> None:
    """The current stream of ``device`` waits for a copy handle (a CUDA event); a deferred copy
    (fault injection) runs now."""
    if handle is None:
        return
    if isinstance(handle, torch.cuda.Event):
        torch.cuda.current_stream(device).wait_event(handle)
    else:
        handle.synchronize()


def get_slot(slot_id: int) -> ParamSlot:
    """The live slot with this id.

    Raises:
        RuntimeError: when it no longer exists.
    """
    slot = _registry.get(slot_id)
    if slot is None:
        raise RuntimeError(f"trinity parameter slot {slot_id} no longer exists")
    return slot


def slot_of(param: torch.Tensor) -> ParamSlot | None:
    """The slot of ``param``, or ``None`` when it is not offloaded."""
    return getattr(param, SLOT_ATTR, None)


def ensure_slot(param: torch.nn.Parameter, pool: HostPool, keep_resident: bool) -> ParamSlot:
    """The slot of ``param``, created (master copy in ``pool``) if it has none.

    Raises:
        ValueError: when ``param`` already has a slot with the other residency mode (one model
            compiled with ``offload="activations+params"`` and ``"all"`` at once).
    """
    slot = slot_of(param)
    if slot is None:
        slot = ParamSlot(param, pool, keep_resident)
        setattr(param, SLOT_ATTR, slot)
    elif slot.keep_resident != keep_resident:
        raise ValueError(
            "trinity: this parameter is already offloaded with offload="
            + ("'activations+params'" if slot.keep_resident else "'all'")
            + "; compile every graph that uses it with the same offload option"
        )
    return slot


@contextlib.contextmanager
def materialized(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Give offloaded parameters their device values for the duration of the block.

    Inside, ``model.state_dict()``, ``torch.save``, an eager forward and ``load_state_dict`` see
    and change the real parameters. On exit, parameters offloaded with ``offload="all"`` are
    copied back into their host master copies (so a ``load_state_dict`` inside takes effect) and
    their device memory is freed again. Waits for pending CPU-optimizer updates first.
    Parameters that are not offloaded are left alone.

    A gradient an uncompiled backward inside the block leaves in ``p.grad`` (under DDP, averaged
    by its reducer through trinity's hook) of a parameter offloaded with ``offload="all"`` is
    added into its host gradient on exit, as a compiled backward's would be (accumulating since
    the last ``zero_grad``), and ``p.grad`` is set to ``None``: ``CPUOptimizer.step()`` then
    updates with it. Where DDP's reducer averaged it together with the host gradient (a synced
    backward after earlier micro-steps, ``grad_sync.idle_comm_hook``), it replaces the host
    gradient instead.
    """
    slots = []
    seen = set()
    for p in params:
        slot = slot_of(p)
        if slot is not None and slot.id not in seen:
            seen.add(slot.id)
            slots.append(slot)
    for slot in slots:
        slot.fetch()
    try:
        yield
    finally:
        for slot in slots:
            if not slot.keep_resident:
                slot.release(write_back=True)
                _hand_device_grad_to_host(slot)


def _hand_device_grad_to_host(slot: ParamSlot) -> None:
    """Move the device ``.grad`` of ``slot``'s parameter (``offload="all"``), if any, into its
    host gradient (added to the gradients since the last ``zero_grad``; see :func:`materialized`)
    and set ``.grad`` to ``None``. Called after the parameter's write-back, so an update the
    arriving gradient starts (``CPUOptimizer(overlap="backward")``) reads the written-back
    master."""
    p = slot.param_ref()
    g = p.grad if p is not None else None
    if g is None:
        return
    p.grad = None
    slot.enable_host_grad()
    slot.finish_grad()
    replace, slot.handover_replaces = slot.handover_replaces, False
    slot.add_grad(g.detach(), replace=replace)


def _in_optimized_module() -> bool:
    """Whether a ``torch.compile``'d module (``OptimizedModule``) is being called right now."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    check = getattr(eval_frame, "_is_in_optimized_module", None)
    return bool(check()) if check is not None else False


def _forward_pre_hook(mod: torch.nn.Module, args) -> None:
    # Traced by Dynamo (is_compiling() is a constant True there): a no-op in compiled code,
    # whose graphs fetch the parameters themselves.
    if torch.compiler.is_compiling() or _in_optimized_module():
        return None
    for p in mod._parameters.values():
        slot = slot_of(p) if p is not None else None
        if slot is not None and not slot.resident:
            raise RuntimeError(f"eager forward of {type(mod).__name__}: " + slot.released_message())
    return None


def _state_dict_post_hook(mod: torch.nn.Module, state_dict, prefix: str, local_metadata) -> None:
    for name, p in mod._parameters.items():
        slot = slot_of(p) if p is not None else None
        key = prefix + name
        # keep_vars=True puts the parameter itself in the dict: left alone.
        if slot is None or key not in state_dict or state_dict[key] is p:
            continue
        slot.wait_ready()
        slot.sync_master_copies()
        if not slot.resident:
            state_dict[key] = slot.master.detach()


def _load_pre_hook(mod, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    slots = [s for s in (slot_of(p) for p in mod._parameters.values() if p is not None) if s is not None]
    if slots and local_metadata.get("assign_to_params_buffers", False):
        raise RuntimeError(
            f"trinity: load_state_dict(assign=True) would replace {slots[0].label()}, which is offloaded "
            "(the compiled code and its host copy keep the old parameter object); use assign=False"
        )
    for slot in slots:
        slot.fetch()


def _load_post_hook(mod: torch.nn.Module, incompatible_keys) -> None:
    for p in mod._parameters.values():
        slot = slot_of(p) if p is not None else None
        if slot is not None and not slot.keep_resident:
            slot.release(write_back=True)


_MODULE_HOOKS = (
    ("_forward_pre_hooks", _forward_pre_hook, "register_forward_pre_hook"),
    ("_state_dict_hooks", _state_dict_post_hook, "register_state_dict_post_hook"),
    ("_load_state_dict_pre_hooks", _load_pre_hook, "register_load_state_dict_pre_hook"),
    ("_load_state_dict_post_hooks", _load_post_hook, "register_load_state_dict_post_hook"),
)


def _has_hook(registry, fn) -> bool:
    for h in registry.values():
        h = getattr(h, "hook", h)  # load_state_dict pre-hooks are wrapped
        if h is fn:
            return True
    return False


def install_module_hooks(module: torch.nn.Module) -> list:
    """Hooks on ``module`` itself (not its children) for the parameters it owns directly
    (``module._parameters``), looked up at each call, so it may be offloaded later:

    * ``state_dict()``: the entry of a released offloaded parameter is its host master copy
      (current: pending CPU-optimizer updates are waited for), a host tensor shaped like the
      parameter (on a GPU a CPU tensor; ``torch.save`` and ``load_state_dict`` accept it). With
      ``keep_vars=True`` the entry stays the parameter.
    * ``load_state_dict()``: offloaded parameters are fetched before the load and, with
      ``offload="all"``, written back into their master copies and released after it.
      ``assign=True`` is refused (``RuntimeError``): it would replace an offloaded parameter.
    * an eager forward (outside ``torch.compile``) while one of them is released raises
      ``RuntimeError`` naming it, instead of reading an empty storage.

    Idempotent: hooks already there are not added twice. Returns the handles of the hooks this
    call added (``handle.remove()`` undoes them).
    """
    handles = []
    for registry, fn, register in _MODULE_HOOKS:
        if not _has_hook(getattr(module, registry), fn):
            handles.append(getattr(module, register)(fn))
    return handles


def install_state_dict_hooks(module: torch.nn.Module) -> list:
    """Make ``module.state_dict()`` and ``module.load_state_dict()`` (and those of its
    submodules) work between steps without :func:`materialized`: :func:`install_module_hooks` on
    ``module`` and every submodule that has parameters.

    The backend does this by itself for the modules it finds from the compiled frame (a model
    compiled with ``torch.compile(model, ...)``, or a module reached from the compiled function's
    locals or globals); this function is for modules it cannot find (parameters passed to the
    compiled function in a list, say).

    Returns the hook handles this call added (``handle.remove()`` undoes them). Parameters
    offloaded later (the model compiled after this call) are covered too: the hooks look the
    slots up at each call.
    """
    handles = []
    for mod in module.modules():
        if mod._parameters:
            handles.extend(install_module_hooks(mod))
    return handles
