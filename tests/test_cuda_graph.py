"""CUDAGraphStep: a replayed training step gives the eager step's losses, parameters and optimiser state."""

from __future__ import annotations

import pytest
import torch

from ligermodels.train.cuda_graph import CUDAGraphStep, warm_up
from tests.utils import DEVICE

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _tiny_model(model_type: str = "llama"):
    """A two-layer model at random init on the GPU; ``"llama+qlora"``: its projections in NF4 with LoRA adapters
    (B non-zero) on all seven."""
    from ligermodels.families import config_from_hf, family_of
    from ligermodels.hf_io import quantize_model
    from ligermodels.lora import add_lora, lora_modules

    model_type, qlora = model_type.split("+")[0], model_type.endswith("+qlora")

    hf = dict(model_type=model_type, vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=model_type == "gemma",
              hidden_act="silu" if model_type == "llama" else "gelu_pytorch_tanh")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = family_of(model_type).cls(config_from_hf(hf)).init_weights().train()
    if qlora:
        add_lora(quantize_model(model), r=8, alpha=16, targets=["q", "k", "v", "o", "gate", "up", "down"])
        for m in lora_modules(model).values():
            torch.nn.init.normal_(m.lora_B, std=0.02)
    return model


@needs_cuda
@pytest.mark.parametrize("model_type", ["llama", "gemma", "llama+qlora"])
@pytest.mark.parametrize("tensor_lr", [False, True])
@pytest.mark.parametrize("optimizer", ["torch", "kernels"])
def test_replayed_steps_match_eager_steps(model_type, tensor_lr, optimizer):
    """Five steps on changing batches, with a learning-rate schedule when the lr is a tensor: the same losses,
    parameters and Adam moments as five eager steps from the same start (fp32, so differences are rounding),
    with torch's fused AdamW and with kernels.AdamW; "+qlora": LoRA on an NF4 base (its dequantisation inside the
    graph)."""
    from kernels import AdamW

    def make():
        model = _tiny_model(model_type)
        lr = torch.tensor(1e-3, device="cuda") if tensor_lr else 1e-3
        params = [p for p in model.parameters() if p.requires_grad]
        if optimizer == "torch":
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1, fused=True, capturable=True)
        else:
            opt = AdamW(params, lr=lr, weight_decay=0.1, capturable=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i)) if tensor_lr else None
        return model, opt, sched

    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, 1000, (2, 300), device="cuda", generator=g) for _ in range(5)]

    eager, opt_e, sched_e = make()
    eager_losses = []
    for ids in batches:
        loss = eager.loss(ids, ids)
        loss.backward()
        opt_e.step()
        opt_e.zero_grad(set_to_none=True)
        eager_losses.append(loss.item())
        if sched_e:
            sched_e.step()

    graphed, opt_g, sched_g = make()
    step = CUDAGraphStep(graphed.loss, opt_g, batches[0], batches[0])
    losses = []
    for ids in batches:
        losses.append(step(ids, ids).item())
        if sched_g:
            sched_g.step()

    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert len(set(losses)) == len(losses)  # each replay read its own batch and updated the weights
    for (name, p), q in zip(graphed.named_parameters(), eager.parameters(), strict=True):
        if not p.requires_grad:  # (frozen: the NF4 base)
            continue
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=f"parameter {name}")
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt_g.state[p][key], opt_e.state[q][key], rtol=1e-4, atol=1e-9,
                                       msg=f"{key} of {name}")


@needs_cuda
def test_capture_after_eager_steps_keeps_the_optimiser_state():
    """Two eager steps, then capture (a resumed run): replays continue exactly as eager steps would."""
    from kernels import AdamW

    g = torch.Generator(device="cuda").manual_seed(2)
    batches = [torch.randint(0, 1000, (2, 128), device="cuda", generator=g) for _ in range(4)]
    runs = []
    for graphed in (False, True):
        model = _tiny_model()
        opt = AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, capturable=True)
        for ids in batches[:2]:
            model.loss(ids, ids).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if graphed:
            step = CUDAGraphStep(model.loss, opt, batches[2], batches[2])
            for ids in batches[2:]:
                step(ids, ids)
        else:
            for ids in batches[2:]:
                model.loss(ids, ids).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        runs.append((model, opt))
    (eager, opt_e), (graphed, opt_g) = runs
    for (name, p), q in zip(graphed.named_parameters(), eager.parameters(), strict=True):
        if not p.requires_grad:  # (frozen: the NF4 base)
            continue
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=f"parameter {name}")
        assert opt_g.state[p]["step"].item() == opt_e.state[q]["step"].item() == 4


def _captured_tiny_step():
    """(step, optimizer, ids): a tiny Llama's step captured on (2, 64) tokens, torch's fused AdamW at lr 1e-3."""
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    ids = torch.randint(0, 1000, (2, 64), device="cuda")
    return CUDAGraphStep(model.loss, opt, ids, ids, warmup=1), opt, ids


@needs_cuda
def test_replay_refuses_a_float_lr_changed_after_capture():
    step, opt, ids = _captured_tiny_step()
    opt.param_groups[0]["lr"] = 5e-4
    with pytest.raises(ValueError, match="lr changed from 0.001 to 0.0005"):
        step(ids, ids)


@needs_cuda
def test_replay_refuses_inputs_of_another_shape():
    step, _, _ = _captured_tiny_step()
    other = torch.randint(0, 1000, (2, 65), device="cuda")
    with pytest.raises(ValueError, match=r"input 0: captured as \(2, 64\)"):
        step(other, other)


def _linear_and_step(opt_cls, lr):
    torch.manual_seed(0)
    layer = torch.nn.Linear(7, 5).to(DEVICE)
    opt = opt_cls(layer.parameters(), lr=lr, weight_decay=0.1)
    x = torch.randn(4, 7, device=DEVICE)

    def step():
        layer(x).square().sum().backward()
        opt.step()

    return layer, opt, step


def _snapshot(layer, opt):
    return ([p.detach().clone() for p in layer.parameters()],
            [{k: v.clone() for k, v in st.items()} for st in opt.state.values()])


@pytest.mark.parametrize("opt_name", ["torch", "kernels"])
@pytest.mark.parametrize("tensor_lr", [False, True])
@pytest.mark.parametrize("eager_steps", [0, 2])
def test_warm_up_leaves_parameters_and_optimiser_as_they_were(opt_name, tensor_lr, eager_steps):
    """Fresh (state created at zero) or after eager steps (state put back): the parameters do not move, the lr
    is the same, and the next step is the one an optimiser without warm-up would take."""
    from kernels import AdamW

    opt_cls = AdamW if opt_name == "kernels" else torch.optim.AdamW
    runs = []
    for warm in (False, True):
        lr = torch.tensor(0.05, device=DEVICE) if tensor_lr else 0.05
        layer, opt, step = _linear_and_step(opt_cls, lr)
        for _ in range(eager_steps):
            opt.zero_grad(set_to_none=True)
            step()
        if warm:
            before = _snapshot(layer, opt)
            warm_up(opt, step, 3)
            params, states = _snapshot(layer, opt)
            for a, b in zip(params, before[0], strict=True):
                assert torch.equal(a, b)
            assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.05)
            if eager_steps:
                for st, old in zip(states, before[1], strict=True):
                    for k in old:
                        assert torch.equal(st[k].cpu(), old[k].cpu()), k
            else:
                assert all(not v.any() for st in states for v in st.values())
        opt.zero_grad(set_to_none=True)
        step()
        runs.append(_snapshot(layer, opt)[0])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_warm_up_restores_the_lr_and_state_when_a_step_fails():
    layer, opt, step = _linear_and_step(torch.optim.AdamW, 0.05)
    step()
    before = _snapshot(layer, opt)

    def failing():
        step()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        warm_up(opt, failing, 2)
    assert opt.param_groups[0]["lr"] == 0.05
    for st, old in zip(_snapshot(layer, opt)[1], before[1], strict=True):
        for k in old:
            assert torch.equal(st[k], old[k]), k


def test_capture_refuses_an_optimiser_it_cannot_replay():
    w = torch.nn.Parameter(torch.zeros(3))
    x = torch.zeros(3)
    with pytest.raises(TypeError, match="SGD"):
        CUDAGraphStep(lambda t: (w * t).sum(), torch.optim.SGD([w], lr=0.1), x)
    with pytest.raises(ValueError, match="capturable=True"):
        CUDAGraphStep(lambda t: (w * t).sum(), torch.optim.AdamW([w], lr=0.1), x)
    with pytest.raises(ValueError, match="input 0 must be a CUDA tensor, got cpu"):
        CUDAGraphStep(lambda t: (w * t).sum(), torch.optim.AdamW([w], lr=0.1, capturable=True), x)
