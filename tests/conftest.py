"""Test setup: with no GPU, run the Triton kernels through the interpreter on the CPU.

TRITON_INTERPRET must be set before triton compiles anything, so it is set here, before any
test module imports ``kernels``. On a CUDA machine the same tests run natively on the GPU.

The interpreter (triton 3.6-3.9) converts fp32 to bf16 by truncating the mantissa, whereas the
GPU rounds to nearest-even. Left alone, every bf16 result on the CPU would carry about twice the
rounding error it has on the GPU, and the "no worse than eager bf16" checks would measure the
simulator rather than the kernels. So, in the interpreter only, fp32->bf16 conversion is made to
round to nearest-even (through torch), as the hardware does. Likewise ``tl.dot`` of bf16 tiles, which the
interpreter computes on their bit patterns, is made to multiply their values (see below).
"""

import os

# Idle OpenMP threads sleep instead of spinning. The suite runs two workers on two cores, and every process
# they start (torchrun ranks, the demos) inherits this: a demo subprocess with two spinning threads beside a
# busy worker ran 3x slower (7.5 min against 2.5 min, the same numbers). Set before torch loads libgomp here,
# and in the xdist workers, which are started after this file is read.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

    import triton.language as tl
    from triton.runtime import interpreter as _interp

    _truncating_convert = getattr(_interp, "_convert_float", None)

    def _convert_float_rne(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return _truncating_convert(data, src, dst, rounding_mode)

    if _truncating_convert is not None:
        _interp._convert_float = _convert_float_rne

    # The interpreter multiplies bf16 tiles in tl.dot as the raw uint16 bit patterns it stores them in
    # (numbers in the hundreds of millions); the hardware multiplies the bf16 values and accumulates in fp32.
    # bf16 -> fp32 is exact, so converting both tiles first gives the hardware's products.
    _builder = getattr(_interp, "InterpreterBuilder", None)
    _dot = getattr(_builder, "create_dot", None)

    def _bf16_as_fp32(h):
        if h.dtype.scalar == tl.bfloat16:
            data = (h.data.astype(np.uint32) << 16).view(np.float32)
            return _interp.TensorHandle(data, tl.float32)
        return h

    def _create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return _dot(self, _bf16_as_fp32(a), _bf16_as_fp32(b), d, input_precision, max_num_imprecise_acc)

    if _dot is not None:
        _builder.create_dot = _create_dot_bf16


def pytest_configure(config):
    """Byte-compile the project's packages once, in the controlling process, before the workers start. Tests start
    Python processes of their own (trainers, torchrun ranks, the demos), and where PYTHONDONTWRITEBYTECODE is set
    (it is on the 2-core CPU this suite is timed on) each would compile every project module it imports from source:
    0.2-0.3 s of the 2.8 s ``import ligermodels.train.loop`` takes there. Written pyc files are read even so."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller did it
        return
    import compileall

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for package in ("kernels", "ligermodels", "checkpoints_tools", "benchmarks"):
        compileall.compile_dir(os.path.join(root, package), quiet=1)


@pytest.fixture
def reference_kernels(monkeypatch):
    """The PyTorch references of the kernels on the CPU, here and in child processes (the Triton interpreter
    the other tests run is slow; for tests that check something other than the kernels). Every kernels module is
    imported first, so none reads its import-time INTERPRET from the changed environment and keeps it
    after this test."""
    import importlib
    import pkgutil

    import kernels

    modules = [importlib.import_module(f"kernels.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for module in [kernels, *modules]:
        if hasattr(module, "INTERPRET"):
            monkeypatch.setattr(module, "INTERPRET", False)


# ------------------------------------------------------------ the training tests' tiny checkpoint and data
@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def checkpoint(workdir) -> str:
    """A tiny random transformers Llama with the demo's character tokenizer beside it."""
    import transformers

    from ligermodels.train.demo import build_tokenizer, save_tokenizer

    tok = build_tokenizer()
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    path = str(workdir / "tiny-llama")
    model.save_pretrained(path)
    save_tokenizer(tok, path)
    return path


@pytest.fixture(scope="module")
def data(workdir) -> str:
    import json

    from ligermodels.train.demo import corpus

    path = workdir / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in corpus(300, seed=1)))
    return str(path)
