"""Hugging Face models, PEFT LoRA and a per-expert MoE: which checkpointing path applies, the tiled
SwiGLU MLP, the DDP probe, and the reentrant -> non_reentrant switch. In one process here; the
2-rank cases (plain torch failing first, then the framework's gradients) come from one torchrun
launch of tests/workers/hf_models.py."""

import functools
import logging
import warnings

import pytest
import torch
import torch.nn as nn

from framework.model.tiled_mlp import TiledSwiGLUFunction, tile_user_mlps
from framework.model.offload import offloaded_checkpoint
from framework.model.activation_checkpointing import apply_checkpointing, checkpointing_of, enable_checkpointing
from framework.model.hf_checkpointing import hf_model_in
from framework.ddp.policy import probe
from framework.trainer import DDPTrainer
from tests.dist_helper import case as dist_case
from tests.workers.hf_models import (
    BATCH,
    FORCED_CASES,
    FRAMEWORK_CASES,
    GRAPH_CHANGED,
    MARKED_TWICE,
    MODES,
    PLAIN_CASES,
    UNFINISHED,
    TokenPairs,
    lm_loss,
    llama,
    moe,
    trainable_grads,
)

WORKER = "tests/workers/hf_models.py"
WORKER_TIMEOUT = 400  # seconds, for the conftest two_ranks fixture
# A case may record the error it expects under "error": the worker names its own failure "harness_error".
case = functools.partial(dist_case, harness_error="harness_error")
TOL = 1e-5
OFF = 1e-3  # a silent failure: gradients at least this far off the reference or across ranks
NO_AUTOCAST = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
DATA = TokenPairs(n=4, seed=9)
X, Y = DATA.x[:3], DATA.y[:3]


def grads(model, x=X, y=Y):
    model.zero_grad(set_to_none=True)
    lm_loss(model(x), y).backward()
    return trainable_grads(model)


def worst(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in b)


def mlps(model):
    return [m for m in model.modules() if type(m).__name__ == "LlamaMLP"]


# --- two ranks: plain torch fails, the framework matches one process -----------------------------

def errors(out):
    return [e for e in out["errors"] if e is not None]


@pytest.mark.dist
def test_plain_torch_lora_hf_reentrant_with_find_unused_marks_twice(two_ranks):
    out = case(two_ranks, 0, "plain-lora-hf_reentrant-find_unused")
    assert len(errors(out)) == 2 and all(MARKED_TWICE in e["full"] and e["iteration"] == 0 for e in errors(out))


@pytest.mark.parametrize("name, expected", [
    ("plain-moe-reentrant-default", UNFINISHED),
    ("plain-moe-reentrant-find_unused", MARKED_TWICE),
    ("plain-moe-reentrant-static", GRAPH_CHANGED),
    ("plain-moe-reentrant-static-find_unused", GRAPH_CHANGED),
])
@pytest.mark.dist
def test_plain_torch_moe_with_reentrant_checkpointing_fails_under_every_ddp_setting(two_ranks, name, expected):
    out = case(two_ranks, 0, name)
    assert out == case(two_ranks, 1, name)
    assert any(expected in e["full"] for e in errors(out)), out["errors"]
    if name.endswith("default"):  # before the error, the first iteration's gradients were silently wrong
        assert out["max_ref_diff"] > OFF and out["max_rank_diff"] > OFF, out


def test_every_plain_case_is_asserted():
    assert len(PLAIN_CASES) == 5


@pytest.mark.parametrize("name", sorted(FRAMEWORK_CASES))
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.dist
def test_framework_gradients_match_single_process(two_ranks, name, rank):
    out = case(two_ranks, rank, name)
    assert out["max_abs_diff"] <= TOL, out
    assert out["unreduced_local_diff"] > 100 * TOL  # the comparison can fail
    assert out["rank_gap"] == 0.0
    assert out["moved"] and out["sha_after_step"][0] == out["sha_after_step"][1]
    assert out["decision"]["safe"]


@pytest.mark.parametrize("name", sorted(FRAMEWORK_CASES))
@pytest.mark.dist
def test_framework_checkpointing_path(two_ranks, name):
    out = case(two_ranks, 0, name)
    kind, overrides = FRAMEWORK_CASES[name]
    mode = overrides.get("memory.activation_checkpointing", "off")
    path = out["checkpointing"]["path"]
    if kind == "moe" or "memory.activation_checkpointing_modules" in overrides:
        assert path == "framework" and any("so the framework wraps them" in line or "on 2 modules" in line
                                           for line in out["log"])
    else:
        assert path == ("off" if mode == "off" else "hf")
        if mode != "off":
            assert any("'s own activation checkpointing" in line for line in out["log"]), out["log"]
    assert (out["offload_packed"] > 0) == (mode == "offload")
    if overrides.get("memory.tiled_mlp_chunks"):
        assert any(line.startswith("tiled MLP (4 chunks) on 2 modules") for line in out["log"]), out["log"]


@pytest.mark.parametrize("name", ["lora-reentrant-tiled0", "lora-non_reentrant-tiled4"])
@pytest.mark.dist
def test_probe_on_lora_excludes_frozen_base_weights(two_ranks, name):
    out = case(two_ranks, 0, name)
    report = out["report"]
    assert report["num_tensors"] == out["trainable"] == 20  # LoRA A and B of 5 projections x 2 layers
    found = report["unused"] + report["multi_fire"] + report["hidden"] + report["changing"] + report["shared"]
    assert all(".lora_A." in n or ".lora_B." in n for n in found), found
    assert report["unused"] == report["multi_fire"] == report["changing"] == []
    if "-reentrant-" in name:  # the LoRA weights inside the reentrant layers, and nothing frozen
        assert len(report["hidden"]) == 20
    else:
        assert report["hidden"] == []
    assert (out["decision"]["static_graph"], out["decision"]["find_unused_parameters"]) == (False, False)


@pytest.mark.dist
def test_moe_reentrant_is_switched_to_non_reentrant(two_ranks):
    for rank in (0, 1):
        out = case(two_ranks, rank, "moe-reentrant-auto")
        assert out["checkpointing"]["mode"] == "non_reentrant"
        decision = out["decision"]
        assert decision["reasons"][0].startswith("gradient checkpointing switched from reentrant to non_reentrant")
        assert "no DDP setting fits" in decision["reasons"][0]
        assert (decision["static_graph"], decision["find_unused_parameters"]) == (False, True)
        assert out["report"]["hidden"] == [] and out["report"]["changing"]
        assert any(line.startswith("gradient checkpointing switched from reentrant to non_reentrant")
                   for line in out["log"])


@pytest.mark.parametrize("name", sorted(FORCED_CASES))
@pytest.mark.dist
def test_forced_ddp_settings_stop_with_the_fix(two_ranks, name):
    for rank in (0, 1):
        out = case(two_ranks, rank, name)
        assert out["error_type"] == "DDPConfigurationError", out
        assert "Fix: set memory.activation_checkpointing=non_reentrant" in out["error"]


# --- which checkpointing path, in one process -------------------------------------------------

@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("mode", MODES)
def test_hf_model_uses_its_own_checkpointing(mode, lora, caplog):
    ref = grads(llama(lora))
    model = llama(lora)
    with caplog.at_level(logging.INFO, logger="framework.model"):
        plan = enable_checkpointing(model, mode, "Block")
    assert checkpointing_of(model) is plan and plan.mode == mode
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert all(m.gradient_checkpointing is (mode != "off") for m in layers)
    if mode != "off":
        assert plan.path == "hf" and len(plan.wrapped) == 2
        assert "LlamaForCausalLM" in caplog.text and "'s own activation checkpointing" in caplog.text
        func = layers[0]._gradient_checkpointing_func
        if mode == "offload":
            assert func.func is offloaded_checkpoint
        else:
            assert func.keywords["use_reentrant"] is (mode == "reentrant")
    model.train()
    assert worst(grads(model), ref) <= 1e-6
    assert (plan.stats.packed, plan.stats.unpacked) == ((2, 2) if mode == "offload" else (0, 0))


def test_framework_wraps_hf_layers_when_checkpoint_modules_names_them(caplog):
    ref = grads(llama(True))
    model = llama(True)
    with caplog.at_level(logging.INFO, logger="framework.model"):
        plan = enable_checkpointing(model, "reentrant", "LlamaDecoderLayer")
    assert plan.path == "framework" and plan.wrapped == [f"base_model.model.model.layers.{i}" for i in (0, 1)]
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert hf_model_in(model).config.use_cache is False  # a recomputed layer must not append to a KV cache
    assert "so the framework wraps them" in caplog.text
    # Keyword arguments (position embeddings, mask) are bound for reentrant checkpoint; LoRA's
    # frozen embeddings get an output that requires grad, as HF and PEFT do.
    assert worst(grads(model), ref) <= 1e-6


def test_reentrant_lora_whose_inputs_need_no_grad_switches_to_non_reentrant():
    """Without enable_input_require_grads every LoRA weight sits inside a reentrant layer whose
    inputs need no gradient: plain reentrant checkpointing raises "does not require grad" (or drops
    the gradients). The framework's wrapper switches the plan to non_reentrant at the first call, and
    the gradients equal those of the model without checkpointing."""
    reference = grads(llama(True))
    model = llama(True)
    plan = enable_checkpointing(model, "reentrant", "LlamaDecoderLayer")
    assert plan.path == "framework"
    hf_model_in(model).disable_input_require_grads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "None of the inputs have requires_grad=True"
        got = grads(model)
    assert plan.mode == "non_reentrant" and plan.switched_because
    assert sorted(got) == sorted(reference) and worst(got, reference) < 1e-6


def test_checkpointing_the_user_enabled_is_kept_and_logged(caplog):
    model = llama(True)
    hf_model_in(model).activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    func = hf_model_in(model).model.layers[0]._gradient_checkpointing_func
    with caplog.at_level(logging.INFO, logger="framework.model"):
        plan = enable_checkpointing(model, "non_reentrant", "LlamaDecoderLayer")
    assert (plan.path, plan.mode, len(plan.wrapped)) == ("user", "reentrant", 2)
    assert hf_model_in(model).model.layers[0]._gradient_checkpointing_func is func
    assert [r.levelname for r in caplog.records if "enabled by the user" in r.getMessage()] == ["WARNING"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="framework.model"):
        assert enable_checkpointing(model, "off", "Block").path == "user"
    assert [r.levelname for r in caplog.records if "enabled by the user" in r.getMessage()] == ["INFO"]


def test_hf_model_inside_a_users_wrapper_is_found():
    class CausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = llama(True)

        def forward(self, x):
            return self.lm(input_ids=x, use_cache=False).logits

    ref = grads(CausalLM())
    wrapper = CausalLM()
    plan = enable_checkpointing(wrapper, "reentrant", "Block")
    assert plan.path == "hf" and hf_model_in(wrapper) is wrapper.lm.base_model.model
    assert worst(grads(wrapper), ref) <= 1e-6


def test_non_hf_models_keep_the_framework_wrapping():
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    assert hf_model_in(net) is None
    plan = enable_checkpointing(net, "reentrant", "Linear")
    assert (plan.path, plan.wrapped) == ("framework", ["0", "2"])
    assert plan.can_switch()
    with pytest.raises(ValueError, match="no submodule matches"):
        enable_checkpointing(nn.Sequential(nn.Linear(4, 4)), "non_reentrant", "Block")
    wrapped, _ = apply_checkpointing(nn.Sequential(nn.Linear(4, 4)), "off", ["Linear"])
    assert wrapped == []


def test_reentrant_refuses_a_keyword_tensor_that_requires_grad():
    class Scale(nn.Module):
        def forward(self, x, *, scale):
            return x * scale

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = Scale()

        def forward(self, x, s):
            return self.scale(x, scale=s)

    net = Net()
    enable_checkpointing(net, "reentrant", "Scale")
    x = torch.randn(2, requires_grad=True)
    assert torch.equal(net(x, torch.tensor(2.0)), x * 2)
    with pytest.raises(ValueError, match="keyword argument 'scale' requires grad"):
        net(x, torch.tensor(2.0, requires_grad=True))


# --- the tiled SwiGLU MLP ---------------------------------------------------------------------

@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("chunks", [1, 3, 4, 12, 50])
def test_tiled_swiglu_matches_the_mlp(lora, chunks):
    mlp = mlps(llama(lora))[0]
    x = torch.randn(2, 12, 32, requires_grad=True)
    params = [p for p in mlp.parameters() if p.requires_grad]
    ref = mlp(x)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [x, *params], g)
    assert tile_user_mlps(nn.ModuleDict({"m": mlp}), chunks, "LlamaMLP") == ["m"]
    out = mlp(x)
    assert type(out.grad_fn).__name__ == TiledSwiGLUFunction.__name__ + "Backward"
    assert (out - ref).abs().max() <= 1e-6
    for a, b in zip(torch.autograd.grad(out, [x, *params], g), ref_grads, strict=True):
        assert (a - b).abs().max() <= TOL


def test_tiled_swiglu_fires_each_trainable_hook_once_and_leaves_frozen_weights_alone():
    model = llama(True)
    tile_user_mlps(model, 4, "LlamaMLP")
    fires = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p, name=name: fires.__setitem__(name, fires.get(name, 0) + 1))
    grads(model)
    assert len(fires) == 20 and set(fires.values()) == {1}
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_tiled_swiglu_keeps_no_chunk_intermediates():
    mlp = mlps(llama(True))[0]
    tensors = [t for t in mlp.parameters()]
    tile_user_mlps(nn.ModuleDict({"m": mlp}), 4, "LlamaMLP")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        mlp(torch.randn(2, 12, 32, requires_grad=True))
    # the input and the weights (base and LoRA, frozen or not); no (B, T, intermediate) activation
    assert sorted(saved) == sorted([2 * 12 * 32] + [t.numel() for t in tensors])


def test_tiled_swiglu_replays_lora_dropout():
    """lora_dropout 0.3: the masks drawn per chunk in forward are drawn again in backward."""
    mlp = mlps(llama(True, lora_dropout=0.3))[0].train()
    params = [p for p in mlp.parameters() if p.requires_grad]
    x = torch.randn(2, 12, 32, requires_grad=True)

    def per_chunk_reference(seed):  # the plain MLP on each chunk, drawing in the same order
        torch.manual_seed(seed)
        out = torch.cat([mlp(c) for c in x.chunk(3, dim=1)], dim=1)
        return out, torch.autograd.grad(out.square().sum(), [x, *params])

    ref, ref_grads = per_chunk_reference(0)
    other, _ = per_chunk_reference(1)
    assert (other - ref).abs().max() > 1e-3  # the masks matter
    tile_user_mlps(nn.ModuleDict({"m": mlp}), 3, "LlamaMLP")
    torch.manual_seed(0)
    out = mlp(x)
    after_forward = torch.get_rng_state()
    got = torch.autograd.grad(out.square().sum(), [x, *params])
    assert torch.equal(torch.get_rng_state(), after_forward)  # backward leaves the RNG alone
    assert (out - ref).abs().max() <= 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(got, ref_grads, strict=True)) <= TOL


def test_tiled_swiglu_with_merged_or_disabled_adapters_uses_the_base_weights():
    model = llama(True)
    x = torch.randn(1, 12, 32)
    tile_user_mlps(model, 4, "LlamaMLP")
    with model.disable_adapter():
        off = mlps(model)[0](x)
    model.merge_adapter()
    merged = mlps(model)[0](x)
    model.unmerge_adapter()
    untiled = llama(True)
    with torch.no_grad(), untiled.disable_adapter():
        assert (off - mlps(untiled)[0](x)).abs().max() <= 1e-6
    with torch.no_grad():
        assert (merged - mlps(untiled)[0](x)).abs().max() <= 1e-5


def test_untileable_mlps_stay_untiled_named_in_one_warning(caplog):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(base, LoraConfig(r=4, use_dora=True, target_modules=["gate_proj"]))
    with caplog.at_level(logging.WARNING, logger="framework.model"):
        with pytest.raises(ValueError, match="no submodule matches"):
            tile_user_mlps(model, 4, "GPTMLP")
        assert tile_user_mlps(model, 4, "LlamaMLP") == []
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "2 modules left untiled" in warned[0]
    assert "base_model.model.model.layers.1.mlp (gate_proj uses a LoRA variant (DoraLinearVariant))" in warned[0]
    assert not any(isinstance(m.forward, functools.partial) for m in mlps(model))


def test_tiled_mlp_modules_config_mistakes():
    with pytest.raises(ValueError, match="LlamaDecoderLayer is not a SwiGLU MLP"):
        tile_user_mlps(llama(False), 4, "LlamaDecoderLayer")
    assert tile_user_mlps(llama(False), 0, "LlamaMLP") == []


def test_user_model_without_tiled_mlp_modules_keeps_the_warning(tmp_path, caplog):
    cfg = {"memory.tiled_mlp_chunks": 4, "batch_size": 2, "num_workers": 0, "logging.tensorboard": False,
           "logging.dir": str(tmp_path), "checkpoint.dir": str(tmp_path / "ck")}
    with caplog.at_level(logging.WARNING, logger="framework.model"):
        trainer = DDPTrainer(cfg, rank=0, world_size=1, model=llama(False), train_dataset=DATA, loss_fn=lm_loss)
    trainer.close()
    assert "tiled_mlp_chunks applies to the built-in model only" in caplog.text
    assert not any(isinstance(m.forward, functools.partial) for m in mlps(trainer.raw_model))



# --- the probe and the switch, in one process -------------------------------------------------

@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_probe_excludes_frozen_parameters_and_runs_in_training_mode(mode):
    model = llama(True)
    enable_checkpointing(model, mode, "Block")
    model.eval()  # as from_pretrained leaves it: the probe must still see training's graph
    batches = [(X, Y), (DATA.x[1:], DATA.y[1:])]
    rep = probe(model, batches, lm_loss, NO_AUTOCAST)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert rep.num_tensors == len(trainable) == 20
    assert rep.num_parameters == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert rep.hidden == (sorted(trainable) if mode == "reentrant" else [])
    assert rep.unused == rep.multi_fire == rep.changing == rep.shared == []
    assert not any(m.training for m in model.modules())  # put back


def doctor(tmp_path, model, overrides: dict | None = None, /, **compact):
    cfg = {**{"batch_size": 1, "num_workers": 0, "logging.tensorboard": False, "logging.dir": str(tmp_path),
              "train.seed": 5, "checkpoint.dir": str(tmp_path / "ck")}, **(overrides or {}), **compact}
    trainer = DDPTrainer(cfg, rank=0, world_size=1, model=model, train_dataset=TokenPairs(), loss_fn=lm_loss,
                         doctor=True)
    trainer.close()
    return trainer


def test_doctor_switches_reentrant_moe_to_non_reentrant(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="framework.model"):
        trainer = doctor(tmp_path, moe(), {"memory.activation_checkpointing": "reentrant",
                                           "memory.activation_checkpointing_modules": "MoELayer"})
    assert trainer.activation_checkpointing.mode == "non_reentrant" and trainer.decision.safe
    assert trainer.decision.reasons[0].startswith("gradient checkpointing switched from reentrant to non_reentrant")
    assert (trainer.decision.static_graph, trainer.decision.find_unused_parameters) == (False, True)
    assert "switched from reentrant to non_reentrant (framework path, 2 modules)" in caplog.text


def test_doctor_keeps_reentrant_when_a_setting_fits(tmp_path):
    trainer = doctor(tmp_path, llama(True), {"memory.activation_checkpointing": "reentrant"}, batch_size=BATCH)
    assert trainer.activation_checkpointing.mode == "reentrant" and trainer.decision.safe
    assert not any("switched" in r for r in trainer.decision.reasons)


def test_doctor_does_not_switch_forced_settings(tmp_path):
    trainer = doctor(tmp_path, moe(), {"memory.activation_checkpointing": "reentrant",
                                       "memory.activation_checkpointing_modules": "MoELayer",
                                       "ddp.static_graph": "true"})
    assert trainer.activation_checkpointing.mode == "reentrant" and not trainer.decision.safe


def test_hf_switch_keeps_the_users_checkpoint_function_otherwise():
    model = llama(True)
    hf = hf_model_in(model)
    hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True,
                                                                        "preserve_rng_state": False})
    plan = enable_checkpointing(model, "off", "Block")
    assert plan.can_switch()
    plan.switch_to_non_reentrant("test")
    func = hf.model.layers[1]._gradient_checkpointing_func
    assert func.keywords == {"use_reentrant": False, "preserve_rng_state": False} and plan.mode == "non_reentrant"
    assert not plan.can_switch()


def test_one_process_training_of_a_lora_model(tmp_path):
    cfg = {"batch_size": 2, "num_workers": 0, "logging.tensorboard": False, "logging.dir": str(tmp_path),
           "target_loss": 0.0, "checkpoint.dir": str(tmp_path / "ck"), "train.max_steps": 3, "learning_rate": 1e-2,
           "train.seed": 5, "memory.activation_checkpointing": "reentrant", "memory.tiled_mlp_chunks": 4,
           "memory.tiled_mlp_modules": "LlamaMLP"}
    summary = DDPTrainer(cfg, rank=0, world_size=1, model=llama(True), train_dataset=TokenPairs(),
                         val_dataset=DATA, loss_fn=lm_loss).train()
    assert summary["steps"] == 3 and torch.isfinite(torch.tensor(summary["final_val_loss"]))
    state = torch.load(tmp_path / "ck" / "final_model.pt", weights_only=True)
    init = llama(True).state_dict()
    lora = [k for k in init if ".lora_" in k]
    assert len(lora) == 20 and all(not torch.equal(state[k], init[k]) for k in lora)
    assert all(torch.equal(state[k], init[k]) for k in init if k not in lora)  # frozen weights untouched


def test_only_a_loss_that_divides_by_num_items_in_batch_is_handed_it():
    """A classifier's forward takes **kwargs as a causal LM's does, but its loss ignores
    num_items_in_batch and returns a mean: handing it the count and dropping the 1/n (as
    transformers.Trainer does) would make its step n x W too large. train.loss_average=tokens
    weighs such a mean by its share of the labels instead."""
    transformers = pytest.importorskip("transformers")
    from framework.model.hf_checkpointing import accepts_loss_kwargs, divides_by_num_items, loss_shifts_labels

    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    assert accepts_loss_kwargs(bert) and not divides_by_num_items(bert) and not loss_shifts_labels(bert)
    assert accepts_loss_kwargs(llama) and divides_by_num_items(llama) and loss_shifts_labels(llama)
    assert not divides_by_num_items(nn.Linear(2, 2)) and not loss_shifts_labels(nn.Linear(2, 2))
