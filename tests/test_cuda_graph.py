"""CUDAGraphStep: a replayed training step gives the eager step's losses, parameters and optimiser state."""

from __future__ import annotations

import pytest
import torch

from ligermodels.cuda_graph import CUDAGraphStep

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _tiny_model(model_type: str = "llama"):
    from ligermodels.families import config_from_hf, family_of

    hf = dict(model_type=model_type, vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=model_type == "gemma",
              hidden_act="silu" if model_type == "llama" else "gelu_pytorch_tanh")
    torch.manual_seed(0)
    with torch.device("cuda"):
        return family_of(model_type).cls(config_from_hf(hf)).init_weights().train()


@needs_cuda
@pytest.mark.parametrize("model_type", ["llama", "gemma"])
@pytest.mark.parametrize("tensor_lr", [False, True])
@pytest.mark.parametrize("optimizer", ["torch", "kernels"])
def test_replayed_steps_match_eager_steps(model_type, tensor_lr, optimizer):
    """Five steps on changing batches, with a learning-rate schedule when the lr is a tensor: the same losses,
    parameters and Adam moments as five eager steps from the same start (fp32, so differences are rounding),
    with torch's fused AdamW and with kernels.AdamW."""
    from kernels import AdamW

    def make():
        model = _tiny_model(model_type)
        lr = torch.tensor(1e-3, device="cuda") if tensor_lr else 1e-3
        if optimizer == "torch":
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=True, capturable=True)
        else:
            opt = AdamW(model.parameters(), lr=lr, weight_decay=0.1, capturable=True)
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
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=f"parameter {name}")
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt_g.state[p][key], opt_e.state[q][key], rtol=1e-4, atol=1e-9,
                                       msg=f"{key} of {name}")


@needs_cuda
def test_replay_refuses_inputs_of_another_shape():
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    ids = torch.randint(0, 1000, (2, 64), device="cuda")
    step = CUDAGraphStep(model.loss, opt, ids, ids, warmup=1)
    other = torch.randint(0, 1000, (2, 65), device="cuda")
    with pytest.raises(ValueError, match=r"input 0: captured as \(2, 64\)"):
        step(other, other)


def test_capture_refuses_an_optimiser_it_cannot_replay():
    w = torch.nn.Parameter(torch.zeros(3))
    x = torch.zeros(3)
    with pytest.raises(TypeError, match="SGD"):
        CUDAGraphStep(lambda t: (w * t).sum(), torch.optim.SGD([w], lr=0.1), x)
    with pytest.raises(ValueError, match="capturable=True"):
        CUDAGraphStep(lambda t: (w * t).sum(), torch.optim.AdamW([w], lr=0.1), x)
    with pytest.raises(ValueError, match="input 0 must be a CUDA tensor, got cpu"):
        CUDAGraphStep(lambda t: (w * t).sum(), torch.optim.AdamW([w], lr=0.1, capturable=True), x)
