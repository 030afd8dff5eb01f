"""Choosing DDP's settings per model: a preflight probe, the decision with its reasons, the
static-graph warm-up, and diagnoses for the errors DDP raises when the settings are wrong.

DDP registers one hook per parameter and expects it to fire exactly once per synced backward,
for exactly the parameters it saw in the forward graph. Three model properties break that:

- unused parameters (no gradient): DDP waits for them forever -> "Expected to have finished
  reduction in the prior iteration" unless find_unused_parameters or static_graph;
- parameters whose hook fires more than once (a weight shared by two reentrant-checkpointed
  blocks, a block recomputed twice): "Expected to mark a variable ready only once", or a silent
  desync when the second firing comes after the reduction finished; only static_graph, which
  counts the firings in its first iteration, handles it;
- parameters hidden from the forward graph (inside a reentrant checkpoint): find_unused_parameters
  marks them unused at the end of forward and then their hooks fire -> "marked ready only once".

static_graph in turn fails when the set of used parameters changes between iterations ("Your
training graph has changed in this iteration"). The probe measures all of these on the
unwrapped model and real batches, and ``decide`` picks the settings.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import re
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..data.batches import batch_loss, num_samples
from ..model.activation_checkpointing import Checkpointing, checkpointing_of
from ..model.loss_without_grad import diagnose_loss_without_grad
from ..resilience.markers import FatalError
from ..resilience.memory import is_oom

log = logging.getLogger(__name__)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside any stack of wrappers exposing ``.module`` (DDP, compile, ...)."""
    seen = set()
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module) and id(model) not in seen:
        seen.add(id(model))
        model = model.module
    return getattr(model, "_orig_mod", model)


@dataclass
class ProbeReport:
    num_parameters: int
    num_tensors: int
    unused: list[str] = field(default_factory=list)  # no gradient in some probe batch
    multi_fire: list[str] = field(default_factory=list)  # gradient accumulated more than once per backward
    hidden: list[str] = field(default_factory=list)  # get a gradient but are not in the forward graph
    changing: list[str] = field(default_factory=list)  # used in one probe batch, unused in another
    shared: list[str] = field(default_factory=list)  # one tensor under several names


@dataclass
class Decision:
    static_graph: bool
    find_unused_parameters: bool
    reasons: list[str]
    safe: bool = True  # False: no DDP setting trains this model correctly, or a forced setting will fail


@contextlib.contextmanager
def preserved_state(model: nn.Module):
    """Restore RNG streams, buffers and ``.grad`` (None stays None) on exit."""
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
           torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}
    try:
        yield
    finally:
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if rng[3] is not None:
            torch.cuda.set_rng_state_all(rng[3])
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
        for n, p in model.named_parameters():
            p.grad = grads[n]


@contextlib.contextmanager
def training_mode(model: nn.Module):
    """Run in training mode, as training will (a Hugging Face model from from_pretrained is in eval
    mode, where it neither checkpoints nor drops out), and put every module's mode back on exit."""
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _graph_leaves(root) -> set[int]:
    """ids of the parameters whose AccumulateGrad nodes are reachable from ``root``'s graph."""
    seen, stack, leaves = set(), [root], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            leaves.add(id(fn.variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return leaves


def probe(model: nn.Module, batches: list, loss_fn, autocast) -> ProbeReport:
    """Run forward and backward on each batch (already on the device) and record
    which parameters get gradients, how often, and whether the forward graph reaches them.
    Leaves weights, buffers, ``.grad`` and RNG exactly as it found them."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            names.setdefault(id(p), []).append(name)
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    report = ProbeReport(sum(p.numel() for p in params.values()), len(params))
    report.shared = sorted(" = ".join(n) for n in names.values() if len(n) > 1)
    fires: dict[int, int] = {}
    used_sets, multi, hidden = [], set(), set()
    handles = [p.register_post_accumulate_grad_hook(
        lambda p: fires.__setitem__(id(p), fires.get(id(p), 0) + 1)) for p in params.values()]
    try:
        with preserved_state(model), training_mode(model):
            for batch in batches:
                for p in params.values():
                    p.grad = None
                fires.clear()
                with autocast():
                    loss = batch_loss(model, batch, loss_fn)
                reachable = _graph_leaves(loss.grad_fn)
                try:
                    loss.backward()
                except RuntimeError as err:
                    rerun = functools.partial(batch_loss, model, batch, loss_fn)  # to name the module
                    diagnosed = diagnose_loss_without_grad(err, model, rerun)
                    if diagnosed is None:
                        raise
                    raise diagnosed from err
                used = {i for i, p in params.items() if p.grad is not None}
                used_sets.append(used)
                multi |= {i for i in used if fires.get(i, 0) > 1}
                hidden |= used - reachable
    finally:
        for h in handles:
            h.remove()
    if not used_sets:
        raise FatalError("the DDP preflight got no batch of the training set to run: the dataset yielded nothing")
    every = set(params)
    ever_used = set().union(*used_sets)
    always_used = set.intersection(*used_sets)
    label = lambda ids: sorted(names[i][0] for i in ids)  # noqa: E731
    report.unused = label(every - always_used)
    report.changing = label(ever_used - always_used)
    report.multi_fire = label(multi)
    report.hidden = label(hidden)
    return report


def agree_on_report(report: ProbeReport, model: nn.Module) -> ProbeReport:
    """OR the findings over all ranks (each rank probed its own batches), so every rank decides alike."""
    if not (dist.is_available() and dist.is_initialized()):
        return report
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    kinds = ("unused", "changing", "multi_fire", "hidden")
    flags = torch.zeros(len(kinds), len(names), dtype=torch.int32)
    for k, kind in enumerate(kinds):
        marked = set(getattr(report, kind))
        flags[k] = torch.tensor([n in marked for n in names], dtype=torch.int32)
    backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flags = flags.to(backend_device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    flags = flags.cpu()
    for k, kind in enumerate(kinds):
        setattr(report, kind, [n for n, f in zip(names, flags[k].tolist(), strict=False) if f])
    return report


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def no_setting_fits(report: ProbeReport) -> bool:
    """A parameter that needs static_graph (hooks firing twice, or unused and hidden ones) while
    the used set changes, which static_graph cannot follow."""
    return bool(report.changing and (report.multi_fire or (report.unused and report.hidden)))


def decide(report: ProbeReport, *, static_graph: str, find_unused: str, checkpointing: str,
           accumulation: int) -> Decision:
    """Pick static_graph and find_unused_parameters ("auto" | "true" | "false" each), with one
    reason per decision. Forced settings are kept, with a warning when the probe says they fail."""
    reasons: list[str] = []
    safe = True
    why_ckpt = f"gradient checkpointing ({checkpointing})" if checkpointing != "off" else "the model"
    if report.multi_fire:
        want_static, want_unused = True, False
        what = "shared parameters" if report.shared else "parameters reached twice"
        reasons.append(f"{why_ckpt} with {what} ({_few(report.multi_fire)}): their gradient hooks fire more "
                       f"than once per backward -> static_graph on, find_unused_parameters off")
    elif report.unused and report.hidden:
        want_static, want_unused = True, False
        reasons.append(f"unused parameters ({_few(report.unused)}) and parameters hidden from the forward "
                       f"graph ({_few(report.hidden)}), e.g. by reentrant checkpointing: find_unused_parameters "
                       f"would mark the hidden ones ready twice -> static_graph on")
    elif report.unused:
        want_static, want_unused = False, True
        reasons.append(f"parameters without a gradient ({_few(report.unused)}) -> find_unused_parameters on"
                       + (", static_graph off (the used set changes between batches)" if report.changing else ""))
    elif report.hidden:
        want_static, want_unused = False, False
        reasons.append(f"parameters hidden from the forward graph ({_few(report.hidden)}), e.g. by reentrant "
                       "checkpointing: find_unused_parameters would mark them unused at the end of the forward and "
                       "then see them marked ready twice -> static_graph off, find_unused_parameters off")
    else:
        want_static, want_unused = False, False
        reasons.append("every parameter gets exactly one gradient per backward -> static_graph off, "
                       "find_unused_parameters off (the fastest setting"
                       + ("; reentrant checkpointing needs it off: it would mark checkpointed parameters "
                          "ready twice)" if checkpointing == "reentrant" else ")"))
    if no_setting_fits(report):
        safe = False
        reasons.append(f"the used parameters change between batches ({_few(report.changing)}): static_graph "
                       f"would fail with 'graph has changed'; no DDP setting fits. Use "
                       f"memory.activation_checkpointing=non_reentrant and untie shared weights")

    static = {"auto": want_static, "true": True, "false": False}[static_graph]
    unused = {"auto": want_unused, "true": True, "false": False}[find_unused]
    if static_graph != "auto" and static != want_static:
        reasons.append(f"static_graph forced {static_graph} (the probe suggests {str(want_static).lower()})")
        if (report.multi_fire and not static) or (static and report.changing):
            safe = False
    if find_unused != "auto" and unused != want_unused:
        reasons.append(f"ddp.find_unused_parameters forced {find_unused} (the probe suggests "
                       f"{str(want_unused).lower()})")
        if unused and report.hidden and not static:
            safe = False
        if not unused and report.unused and not static:
            safe = False
    if static and accumulation > 1:
        reasons.append("static_graph with no_sync() accumulation: one synced warm-up backward runs first, "
                       "or DDP asserts (expect_autograd_hooks_)")
    return Decision(static, unused, reasons, safe)


def wrap(model: nn.Module, device: torch.device, decision: Decision, *, bucket_cap_mb: float,
         gradient_as_bucket_view: bool, broadcast_buffers: bool) -> DDP:
    # torch 2.13 deprecates broadcast_buffers (with a warning) but its replacement still syncs
    # buffers at init, so the keyword is passed only when a user turns the broadcast off.
    extra = {} if broadcast_buffers else {"broadcast_buffers": False}
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               static_graph=decision.static_graph, find_unused_parameters=decision.find_unused_parameters,
               bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view, **extra)


def warm_up(ddp_model: DDP, batch, loss_fn, autocast) -> None:
    """One synced forward/backward whose gradients are discarded and whose RNG use is undone.

    static_graph records its graph in the first backward; if that backward runs inside
    no_sync(), DDP asserts (expect_autograd_hooks_). DDP also rebuilds its buckets after the
    first backward (the second under static_graph), which PowerSGD's per-bucket state must not
    see. Doing this at every process start makes a fresh and a resumed process compute every
    real step the same way."""
    module = ddp_model.module
    with preserved_state(module), training_mode(ddp_model):
        with autocast():
            loss = batch_loss(ddp_model, batch, loss_fn)
        loss.backward()
        for p in module.parameters():
            p.grad = None


# Substrings of DDP's errors (matched case-insensitively, first match wins) -> what it means here
# and which setting fixes it. "graph has changed" comes first: DDP's message for it also begins
# with "Expected to have finished reduction".
DIAGNOSES = {
    "Expected to mark a variable ready only once": (
        "a parameter's gradient hook fired twice in one backward (a weight shared by reentrant-checkpointed "
        "blocks, a block checkpointed twice, or ddp.find_unused_parameters with reentrant checkpointing)",
        "set ddp.static_graph=auto (or true) and ddp.find_unused_parameters=auto, or pass use_reentrant=False to "
        "the model's checkpoint calls (the framework's own: memory.activation_checkpointing=non_reentrant)"),
    "training graph has changed in this iteration": (
        "ddp.static_graph is on but the set of parameters used changed between iterations",
        "set ddp.static_graph=false and ddp.find_unused_parameters=true (or both auto)"),
    "Expected to have finished reduction in the prior iteration": (
        "some parameters got no gradient in the last backward, and DDP waited for them",
        "set ddp.find_unused_parameters=true (or auto), or make every parameter take part in the loss"),
    "expect_autograd_hooks_": (
        "static_graph's first backward ran inside no_sync()",
        "let the framework run its static-graph warm-up (ddp.static_graph=auto or true), or use "
        "data.gradient_accumulation_steps=1"),
}


class DDPConfigurationError(FatalError):
    """A DDP error recognised and explained; fatal: every rank stops."""


def reducer_parameter_names(model: nn.Module) -> list[str]:
    """The names of DDP's parameters in its reducer's order (the indices in its errors): those that
    require grad, shared ones once, less the ones it ignores."""
    ignored = getattr(model, "parameters_to_ignore", set())
    return [n for n, p in unwrap(model).named_parameters() if p.requires_grad and n not in ignored]


def parameters_named_in(text: str, model: nn.Module | None) -> list[str]:
    """The parameters a DDP error names: by name (TORCH_DISTRIBUTED_DEBUG, or the marked-twice one),
    else by the reducer indices it lists, mapped through ``model``."""
    named = re.findall(r"with name (\S+) has been marked", text)
    listed = re.search(r"Parameters which did not receive grad for rank \d+: (.+)", text)
    if listed:
        named += [n.strip() for n in listed.group(1).split(",") if n.strip()]
    if named or model is None:
        return list(dict.fromkeys(named))
    indices = re.findall(r"Parameter at index (\d+)", text)
    listed = re.search(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)", text)
    if listed:
        indices += listed.group(1).split()
    order = reducer_parameter_names(model)
    return list(dict.fromkeys(order[int(i)] for i in indices if int(i) < len(order)))


def modules_of(parameters: list[str], model: nn.Module | None) -> str:
    """"module 'name' (Class)", or "modules ..." with a few of them: those holding ``parameters``."""
    names = list(dict.fromkeys(p.rpartition(".")[0] for p in parameters))
    root = unwrap(model) if model is not None else None
    labels = []
    for name in names:
        try:
            kind = f" ({type(root.get_submodule(name)).__name__})" if root is not None else ""
        except AttributeError:  # a name from DDP's debug output that this model does not hold
            kind = ""
        labels.append(f"'{name}'{kind}" if name else "the model's own parameters")
    return ("module " if len(labels) == 1 else "modules ") + _few(labels)


def diagnose(err: BaseException, model: nn.Module | None = None) -> DDPConfigurationError | None:
    """The diagnosis of a DDP error (None if ``err`` is not one we know): the modules its parameters
    belong to (mapped through ``model``, the DDP-wrapped one, when the error gives only indices),
    the cause and the setting that fixes it, on the first line; DDP's own first line after it."""
    text = str(err)
    for needle, (cause, fix) in DIAGNOSES.items():
        if needle.lower() not in text.lower():
            continue
        parameters = parameters_named_in(text, model)
        where = (f" in {modules_of(parameters, model)} (parameters {_few(parameters)})" if parameters
                 else " (DDP's error names no parameter)")
        return DDPConfigurationError(f"DDP error '{needle}'{where}: {cause}. Fix: {fix}.\n"
                                     f"DDP's error: {text.splitlines()[0] if text else type(err).__name__}")
    return None


def format_report(report: ProbeReport, decision: Decision) -> str:
    lines = [f"parameters: {report.num_parameters:,} in {report.num_tensors} tensors",
             f"unused parameters: {_few(report.unused) or 'none'}",
             f"shared parameters: {_few(report.shared) or 'none'}",
             f"gradient hooks firing more than once: {_few(report.multi_fire) or 'none'}",
             f"parameters hidden from the forward graph: {_few(report.hidden) or 'none'}",
             f"used set changing between batches: {_few(report.changing) or 'none'}",
             f"chosen: static_graph={decision.static_graph}, "
             f"find_unused_parameters={decision.find_unused_parameters}"]
    lines += [f"  because {r}" for r in decision.reasons]
    lines.append("training would be safe" if decision.safe else "training would FAIL with these settings")
    return "\n".join(lines)


def wrap_for_training(model: nn.Module, batches: list, loss_fn, autocast, cfg, device: torch.device,
                      comm_hook=None) -> tuple[DDP, ProbeReport, Decision]:
    """Probe, decide (logging one line per decision), wrap, warm up a static graph (or PowerSGD's
    buckets), and register ``comm_hook`` (framework/ddp/comm_hooks.py) after the warm-up.
    ``batches`` are this rank's first micro-batches (on the device); the first is the warm-up's."""
    report, decision = preflight(model, batches, loss_fn, autocast, cfg)
    for reason in decision.reasons:
        log.info("DDP policy: %s", reason)
    if not decision.safe:
        message = "DDP preflight: these settings will fail for this model:\n" + format_report(report, decision)
        if cfg.ddp.static_graph == "auto" and cfg.ddp.find_unused_parameters == "auto":
            raise DDPConfigurationError(message)
        plan = checkpointing_of(model)
        if no_setting_fits(report) and plan is not None and plan.mode == "reentrant":
            fix = ("enable the model's checkpointing with use_reentrant=False" if plan.path == "user"
                   else "set memory.activation_checkpointing=non_reentrant")
            raise DDPConfigurationError(
                f"{message}\nNo DDP setting trains this model under reentrant checkpointing, and the framework "
                "switches to non_reentrant only when ddp.static_graph and ddp.find_unused_parameters are both auto. "
                f"Fix: {fix} (or leave both DDP settings on auto)")
        log.warning("%s\n(kept because ddp.static_graph/ddp.find_unused_parameters were set explicitly)", message)
    ddp_model = wrap(model, device, decision, bucket_cap_mb=cfg.ddp.bucket_cap_mb,
                     gradient_as_bucket_view=cfg.ddp.gradient_as_bucket_view,
                     broadcast_buffers=cfg.ddp.broadcast_buffers)
    for _ in range(max(int(decision.static_graph), comm_hook.warm_ups(decision.static_graph) if comm_hook else 0)):
        warm_up(ddp_model, batches[0], loss_fn, autocast)
    if comm_hook is not None:
        comm_hook.register(ddp_model)
    return ddp_model, report, decision


def prepare(model: nn.Module, batches, loss_fn, autocast, cfg, device: torch.device, *, distributed: bool,
            doctor: bool, comm_hook=None) -> tuple[nn.Module, ProbeReport | None, Decision | None]:
    """The model to train and the preflight's report and decision: only the preflight for
    ``doctor``, the wrapped model (with ``comm_hook``) when ``distributed``, the model itself otherwise.
    ``batches()`` returns this rank's first micro-batches (read only when needed)."""
    if doctor:
        return (model, *preflight(model, batches(), loss_fn, autocast, cfg))
    if distributed:
        return wrap_for_training(model, batches(), loss_fn, autocast, cfg, device, comm_hook)
    if comm_hook is not None and comm_hook.name != "none":
        log.info("ddp.comm_hook=%s: not used by one process (there is no all-reduce)", comm_hook.name)
    return model, None, None


class PreflightOOM(RuntimeError):
    """Out of memory in the preflight probe on some rank (agreed by all), before any DDP collective."""


def _agreed_probe(model: nn.Module, batches: list, loss_fn, autocast) -> ProbeReport:
    """The probe, OR-reduced over ranks; an out-of-memory error on any rank is agreed on and raised
    as PreflightOOM on every rank."""
    try:
        report, oom = probe(model, batches, loss_fn, autocast), False
    except RuntimeError as err:
        if not is_oom(err):
            raise
        report, oom = ProbeReport(0, 0), True
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([float(oom)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        oom = bool(flag.item())
    if oom:
        raise PreflightOOM(f"out of memory in the DDP preflight probe at micro-batch {num_samples(batches[0])}")
    return agree_on_report(report, model)


def _decide(report: ProbeReport, cfg, plan: Checkpointing | None) -> Decision:
    return decide(report, static_graph=cfg.ddp.static_graph, find_unused=cfg.ddp.find_unused_parameters,
                  checkpointing=plan.mode if plan is not None else cfg.memory.activation_checkpointing,
                  accumulation=cfg.data.gradient_accumulation_steps)


def _switch_reason(report: ProbeReport) -> str:
    what = "fires gradient hooks twice" if report.multi_fire else "hides parameters from the forward graph"
    return (f"the parameters used change between batches ({_few(report.changing)}) and reentrant checkpointing "
            f"{what} ({_few(report.multi_fire or report.hidden)}): no DDP setting fits (static_graph cannot follow "
            "a changing graph; without it DDP marks the hidden or twice-firing parameters wrongly); non_reentrant "
            "checkpointing computes the same gradients and shows DDP every parameter")


def _switched_in_probe(model: nn.Module, batches: list, loss_fn, autocast, plan: Checkpointing | None,
                       ) -> tuple[ProbeReport, str]:
    """The agreed probe, and why the checkpointing switched to non_reentrant during it ('' if it
    did not): a reentrant-checkpointed module without inputs that require grad switches it
    (framework/model/activation_checkpointing.py). Then every rank switches, and the model is probed again: the
    first probe ran partly reentrant."""
    before = plan.mode if plan is not None else None
    report = _agreed_probe(model, batches, loss_fn, autocast)
    # Every rank takes part, whatever its plan: a replica joining a run in place probes a fresh,
    # reentrant plan where the members' switched at their start.
    switched = torch.tensor([float(before == "reentrant" and plan.mode != before)])
    if dist.is_available() and dist.is_initialized():
        switched = switched.to("cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(switched, op=dist.ReduceOp.MAX)
    if not switched.item():
        return report, ""
    if plan is not None and plan.mode == "reentrant":
        plan.switch_to_non_reentrant("another rank's probe switched it")
    return _agreed_probe(model, batches, loss_fn, autocast), plan.switched_because


def preflight(model: nn.Module, batches: list, loss_fn, autocast, cfg) -> tuple[ProbeReport, Decision]:
    """The probe and the decision (alone for --doctor). When no DDP setting fits because of
    reentrant checkpointing and both DDP settings are auto, the checkpointing is re-applied as
    non_reentrant (every rank alike: the findings are agreed) and the model probed again."""
    plan = checkpointing_of(model)
    report, switched = _switched_in_probe(model, batches, loss_fn, autocast, plan)
    decision = _decide(report, cfg, plan)
    if switched:
        decision.reasons.insert(0, f"gradient checkpointing switched from reentrant to non_reentrant: {switched}")
    auto = cfg.ddp.static_graph == "auto" and cfg.ddp.find_unused_parameters == "auto"
    if no_setting_fits(report) and auto and plan is not None and plan.can_switch():
        reason = _switch_reason(report)
        plan.switch_to_non_reentrant(reason)
        report = _agreed_probe(model, batches, loss_fn, autocast)
        decision = _decide(report, cfg, plan)
        decision.reasons.insert(0, f"gradient checkpointing switched from reentrant to non_reentrant: {reason}")
    return report, decision
