"""A trainer killed with SIGKILL leaves nothing that loads wrong, and ``--resume`` finishes its run bit for bit.

Each scenario runs ``python -m ligermodels.train`` (a tiny Llama drawn from its config with ``--from-scratch``, the
demo's character tokenizer, 6 fp32 steps on the CPU, a checkpoint every 2 steps) and kills it with a real SIGKILL:
no handler, ``finally`` or flush runs. Most kills are placed by a ``sitecustomize`` put first on the child's
PYTHONPATH. It wraps a library function the trainer calls and SIGKILLs its own process at the call that
``CRASH_AT=point:N`` names (and writes the point to the file ``CRASH_MARK`` first, so the test knows it fired):

* ``backward:N``: before the N-th ``torch.autograd.backward`` (what ``Tensor.backward`` calls): inside step N;
* ``dcp_save:N``: after the N-th ``torch.distributed.checkpoint.save`` returns: a checkpoint's shards and
  ``.metadata`` are written, its RNG file and train_state.json are not;
* ``rng_save:N``: after the N-th ``torch.save`` into a directory of ``checkpoints/`` (a checkpoint's RNG file):
  all but train_state.json written;
* ``commit:N``: before the N-th ``os.replace`` onto a ``checkpoints/step_*`` directory: the checkpoint is
  written in full, the rename that commits it is not done;
* ``prune:N``: at the N-th ``shutil.rmtree`` of an existing directory of ``checkpoints/`` (in a fresh run the first
  is the pruning of an old checkpoint, ``--keep-checkpoints``), its first file by name other than
  train_state.json is removed, then the kill. rmtree removes files in the order the filesystem lists them, so
  this is what a kill after its first removal leaves wherever train_state.json is not listed first;
* ``export_file:N``: the N-th file ``safetensors.torch.save_file`` writes is cut to half its length, then the
  kill: a half-written ``final/`` export;
* ``export_commit:N``: before the N-th ``os.replace`` onto ``OUT/final``: the export is written, not renamed;
* ``metrics_rewrite:N``: right after the N-th ``open()`` for writing of a file named ``metrics.jsonl*``: a
  resumed run killed as it rewrites the metrics lines it keeps.

One scenario is killed from outside: the test process sends SIGKILL once metrics.jsonl shows step 3 (the child
sleeps before each backward so that steps remain to be killed in), at whatever point the run has reached. One
runs on 2 ranks (torchrun, gloo) and kills rank 1 after its checkpoint shards, while rank 0 goes on.

After each kill the output directory is copied aside and checked: every ``checkpoints/step_N`` (the names
``--resume`` takes) holds exactly what the uninterrupted run's ``step_N`` holds (file names, weights, optimiser
state, RNG states, train_state.json), and ``final/`` is absent or identical to the uninterrupted run's. Then the
same command with ``--resume`` runs to the end: it resumes from the newest complete checkpoint, its
``final/`` equals the uninterrupted run's byte for byte, its metrics.jsonl repeats the uninterrupted run's loss,
gradient norm, lr and token count of every step, and its checkpoints are the uninterrupted run's.

The children use the PyTorch reference kernels (``TRITON_INTERPRET=0``); two run at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ligermodels.train.demo import DEMO_HF_CONFIG, build_tokenizer, corpus, save_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 180
STEPS, SAVE_EVERY = 6, 2

SITECUSTOMIZE = r'''
"""SIGKILL this process at the call CRASH_AT ("point:N") names; CRASH_RANK: only in that torchrun rank."""
import builtins
import os
import re
import shutil
import signal
import time

_spec = os.environ.get("CRASH_AT", "")
_point, _, _n = _spec.partition(":")
_calls = {}


def _due(point):
    _calls[point] = _calls.get(point, 0) + 1
    return _calls[point] == int(_n)


def _die():
    with open(os.environ["CRASH_MARK"], "w") as f:
        f.write(_spec)
    os.kill(os.getpid(), signal.SIGKILL)


def _name(path):
    return os.path.basename(os.path.normpath(os.fspath(path)))


def _in_checkpoints(path):
    """Whether ``path`` is an entry of an OUT/checkpoints directory."""
    return _name(os.path.dirname(os.path.normpath(os.fspath(path)))) == "checkpoints"


if _point and os.environ.get("RANK", "0") == os.environ.get("CRASH_RANK", os.environ.get("RANK", "0")):
    if _point in ("backward", "slow"):
        import torch.autograd

        _backward = torch.autograd.backward

        def backward(*args, **kwargs):
            if _point == "slow":
                time.sleep(float(_n))
            elif _due("backward"):
                _die()
            return _backward(*args, **kwargs)

        torch.autograd.backward = backward
    elif _point == "dcp_save":
        import torch.distributed.checkpoint as dcp

        _save = dcp.save

        def save(*args, **kwargs):
            result = _save(*args, **kwargs)
            if _due("dcp_save"):
                _die()
            return result

        dcp.save = save
    elif _point == "rng_save":
        import torch

        _torch_save = torch.save

        def torch_save(obj, f, *args, **kwargs):
            result = _torch_save(obj, f, *args, **kwargs)
            if isinstance(f, (str, os.PathLike)) and _in_checkpoints(os.path.dirname(f)) and _due("rng_save"):
                _die()
            return result

        torch.save = torch_save
    elif _point in ("commit", "export_commit"):
        _replace = os.replace
        _target = r"step_\d+" if _point == "commit" else r"final"

        def replace(src, dst, *args, **kwargs):
            if re.fullmatch(_target, _name(dst)) and _due(_point):
                _die()
            return _replace(src, dst, *args, **kwargs)

        os.replace = replace
    elif _point == "prune":
        _rmtree = shutil.rmtree

        def rmtree(path, *args, **kwargs):
            if _in_checkpoints(path) and os.path.isdir(path) and _due("prune"):
                others = sorted(set(os.listdir(path)) - {"train_state.json"})
                if others:
                    os.remove(os.path.join(path, others[0]))
                _die()
            return _rmtree(path, *args, **kwargs)

        shutil.rmtree = rmtree
    elif _point == "export_file":
        import safetensors.torch

        _save_file = safetensors.torch.save_file

        def save_file(tensors, filename, *args, **kwargs):
            result = _save_file(tensors, filename, *args, **kwargs)
            if _due("export_file"):
                os.truncate(filename, os.path.getsize(filename) // 2)
                _die()
            return result

        safetensors.torch.save_file = save_file
    elif _point == "metrics_rewrite":
        _open = builtins.open

        def open(file, mode="r", *args, **kwargs):
            f = _open(file, mode, *args, **kwargs)
            if isinstance(file, (str, os.PathLike)) and _name(file).startswith("metrics.jsonl") and "w" in mode:
                if _due("metrics_rewrite"):
                    _die()
            return f

        builtins.open = open
    else:
        raise SystemExit(f"CRASH_AT={_spec}: unknown point")
'''


class RunFailed(Exception):
    """A run did not do what the scenario needs (finished instead of dying, died elsewhere, failed to resume)."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    #: CRASH_AT of each killed run, in order (the later ones run with --resume); "outside": the test kills it
    kills: tuple[str, ...]
    #: the newest complete checkpoint every kill leaves (None: wherever the kill landed)
    newest: int | None
    #: the checkpoints a finished run keeps
    kept: tuple[int, ...] = (2, 4, 6)
    nproc: int = 1
    flags: tuple[str, ...] = ()
    crash_rank: int | None = None


SCENARIOS = (
    Scenario("inside_a_step", ("backward:5",), 4),
    Scenario("from_outside_after_step_3", ("outside",), None),
    Scenario("after_the_checkpoint_shards", ("dcp_save:2",), 2),
    Scenario("after_the_checkpoint_rng_file", ("rng_save:2",), 2),
    Scenario("before_the_checkpoint_rename", ("commit:3",), 4),
    # --keep-checkpoints changes which checkpoints stay, not the numbers: the same uninterrupted run compares
    Scenario("pruning_an_old_checkpoint", ("prune:1",), 6, kept=(4, 6), flags=("--keep-checkpoints", "2")),
    Scenario("half_way_through_the_export_file", ("export_file:1",), 6),
    Scenario("before_the_export_rename", ("export_commit:1",), 6),
    Scenario("a_resume_rewriting_metrics", ("backward:5", "metrics_rewrite:1"), 4),
    Scenario("two_ranks_rank_1_after_its_checkpoint_shards", ("dcp_save:2",), 2, nproc=2, crash_rank=1),
)


SCENARIO_PARAMS = [pytest.param(s, id=s.name) for s in SCENARIOS]


# ---------------------------------------------------------------------------------------------- runs
def _env(site: Path, **crash: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRASH_")}
    return {**env, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(site), ROOT]), **crash}


def _command(nproc: int) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*(launcher if nproc > 1 else [sys.executable]), "-m", "ligermodels.train"]


def _flags(inputs: dict, out: Path, nproc: int, extra=()) -> list[str]:
    """The run: global batch 2 x 32 tokens however many ranks, cosine lr after 1 warmup step."""
    return ["--model", inputs["model"], "--from-scratch", "--data", inputs["data"], "--out", str(out),
            "--seq-len", "32", "--batch-size", str(2 // nproc), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--lr", "1e-2", "--warmup-steps", "1", "--dtype", "fp32", "--device", "cpu", *extra]


def _run(args: list[str], nproc: int, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([*_command(nproc), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


def _metrics(out: Path) -> list[dict]:
    """The lines of OUT/metrics.jsonl that parse (a kill may cut the last one short)."""
    lines = []
    path = out / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return lines


def _kill_from_outside(args: list[str], env: dict, log: Path, out: Path) -> None:
    """Start the run and SIGKILL it once step_2 is committed and metrics.jsonl shows step 3."""
    with open(log, "w") as f:
        p = subprocess.Popen([*_command(1), *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TIMEOUT
        while p.poll() is None:
            if (out / "checkpoints" / "step_00000002").is_dir() and any(m["step"] >= 3 for m in _metrics(out)):
                os.kill(p.pid, signal.SIGKILL)
                break
            if time.monotonic() > deadline:
                raise RunFailed("the run neither reached step 3 nor ended")
            time.sleep(0.01)
        p.wait(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    if p.returncode != -signal.SIGKILL:
        raise RunFailed(f"the run ended with status {p.returncode} before it was killed:\n{log.read_text()[-3000:]}")


@dataclasses.dataclass
class Outcome:
    killed: list[Path]  # OUT as each kill left it (copies)
    out: Path  # OUT after the final --resume
    resumed: subprocess.CompletedProcess


def _play(s: Scenario, inputs: dict, site: Path, workdir: Path) -> Outcome:
    """Each kill of ``s`` in turn (OUT copied aside after each), then --resume to the end."""
    work = workdir / s.name
    work.mkdir()
    out = work / "out"
    killed = []
    for i, kill in enumerate(s.kills):
        args = _flags(inputs, out, s.nproc, (*s.flags, *(["--resume"] if i else [])))
        if kill == "outside":
            _kill_from_outside(args, _env(site, CRASH_AT="slow:0.5"), work / f"run{i}.log", out)
        else:
            mark = work / f"mark{i}"
            crash = {"CRASH_AT": kill, "CRASH_MARK": str(mark)}
            if s.crash_rank is not None:
                crash["CRASH_RANK"] = str(s.crash_rank)
            res = _run(args, s.nproc, _env(site, **crash))
            died = res.returncode == -signal.SIGKILL if s.nproc == 1 else res.returncode != 0
            if not (died and mark.exists() and mark.read_text() == kill):
                raise RunFailed(f"CRASH_AT={kill} did not kill the run (status {res.returncode}):\n"
                                f"{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
        snapshot = work / f"killed{i}"
        shutil.copytree(out, snapshot, symlinks=True)
        killed.append(snapshot)
    resumed = _run(_flags(inputs, out, s.nproc, (*s.flags, "--resume")), s.nproc, _env(site))
    return Outcome(killed, out, resumed)


def _uninterrupted(inputs: dict, site: Path, out: Path, nproc: int) -> Path:
    res = _run(_flags(inputs, out, nproc), nproc, _env(site))
    if res.returncode != 0:
        raise RunFailed(f"the uninterrupted run failed:\n{res.stderr[-4000:]}")
    return out


@pytest.fixture(scope="module")
def played(tmp_path_factory) -> dict:
    """The uninterrupted runs (``uninterrupted-1``, ``uninterrupted-2`` ranks) and every scenario's Outcome (or the
    exception that stopped it), two runs at a time."""
    workdir = tmp_path_factory.mktemp("crash")
    model = workdir / "model"
    tok = build_tokenizer()
    save_tokenizer(tok, str(model))
    config = {**DEMO_HF_CONFIG, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": tok.get_vocab_size()}
    (model / "config.json").write_text(json.dumps(config))
    (workdir / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in corpus(300, seed=1)))
    inputs = {"model": str(model), "data": str(workdir / "data.jsonl")}
    site = workdir / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)

    jobs = {f"uninterrupted-{n}": functools.partial(_uninterrupted, inputs, site, workdir / f"uninterrupted-{n}", n)
            for n in (2, 1)}
    ordered = sorted(SCENARIOS, key=lambda s: -s.nproc)  # the torchrun ones first: they take longest
    jobs.update({s.name: functools.partial(_play, s, inputs, site, workdir) for s in ordered})
    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
    return {name: f.exception() or f.result() for name, f in futures.items()}


def _get(played: dict, name: str):
    result = played[name]
    if isinstance(result, BaseException):
        raise result
    return result


# ---------------------------------------------------------------------------------------------- checks
def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@functools.cache
def _dcp_contents(path: str) -> dict:
    """Everything a torch.distributed.checkpoint directory holds, read through a torch.save file."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(path, os.path.join(scratch, "all.pt"))
        return torch.load(os.path.join(scratch, "all.pt"), weights_only=True)


def _checkpoint_problems(ckpt: Path, reference: Path) -> list[str]:
    """How ``ckpt`` differs from the uninterrupted run's checkpoint of its step."""
    where = f"checkpoints/{ckpt.name}"
    if not reference.is_dir():
        return [f"{where}: the uninterrupted run has no such checkpoint"]
    names, want = set(os.listdir(ckpt)), set(os.listdir(reference))
    if names != want:
        return [f"{where} looks complete but lacks {sorted(want - names)} (and has extra {sorted(names - want)})"]
    problems = []
    if json.loads((ckpt / "train_state.json").read_text()) != json.loads((reference / "train_state.json").read_text()):
        problems.append(f"{where}/train_state.json differs from the uninterrupted run's")
    for name in sorted(n for n in names if n.endswith(".pt")):
        if not _same(torch.load(ckpt / name, weights_only=True), torch.load(reference / name, weights_only=True)):
            problems.append(f"{where}/{name} (RNG state) differs from the uninterrupted run's")
    try:
        contents = _dcp_contents(str(ckpt))
    except Exception as e:  # any failure to read it is the finding
        return [*problems, f"{where} does not load: {type(e).__name__}: {e}"]
    if not _same(contents, _dcp_contents(str(reference))):
        problems.append(f"{where}: weights or optimiser state differ from the uninterrupted run's")
    return problems


def _export_problems(final: Path, reference: Path) -> list[str]:
    """How ``final/`` differs from the uninterrupted run's (it must load, and be that export byte for byte)."""
    names, want = set(os.listdir(final)), set(os.listdir(reference))
    if names != want:
        return [f"final/ lacks {sorted(want - names)} (and has extra {sorted(names - want)})"]
    try:
        json.loads((final / "config.json").read_text())
        load_file(final / "model.safetensors")
    except Exception as e:
        return [f"final/ does not load: {type(e).__name__}: {e}"]
    return [f"final/{n} differs from the uninterrupted run's" for n in sorted(names)
            if (final / n).read_bytes() != (reference / n).read_bytes()]


def _problems(out: Path, reference: Path) -> list[str]:
    """What in ``out`` looks complete but is not what the uninterrupted run (``reference``) wrote."""
    problems = []
    root = out / "checkpoints"
    for ckpt in sorted(root.iterdir()) if root.is_dir() else []:
        if re.fullmatch(r"step_\d{8}\.tmp", ckpt.name):
            continue  # never resumed from; the next run deletes it
        if not re.fullmatch(r"step_\d{8}", ckpt.name):
            problems.append(f"checkpoints/{ckpt.name}: neither a checkpoint nor one being written")
        elif not (ckpt / "train_state.json").is_file():
            problems.append(f"checkpoints/{ckpt.name} has no train_state.json")
        else:
            problems += _checkpoint_problems(ckpt, reference / "checkpoints" / ckpt.name)
    if (out / "final").exists():
        problems += _export_problems(out / "final", reference / "final")
    return problems


def _complete_steps(out: Path) -> list[int]:
    root = out / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.glob("step_*")
                  if re.fullmatch(r"step_\d{8}", p.name) and (p / "train_state.json").is_file())


# ---------------------------------------------------------------------------------------------- tests
def test_the_uninterrupted_runs_write_every_checkpoint_and_a_loadable_export(played):
    for nproc in (1, 2):
        out = _get(played, f"uninterrupted-{nproc}")
        assert _complete_steps(out) == [2, 4, 6]
        assert [m["step"] for m in _metrics(out)] == list(range(1, STEPS + 1))
        assert _problems(out, out) == []
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out / "final"))


@pytest.mark.parametrize("scenario", SCENARIO_PARAMS)
def test_a_killed_run_leaves_no_checkpoint_or_export_that_looks_complete_but_is_not(played, scenario):
    """Every step_N the kill left is the uninterrupted run's step_N, and final/ is absent or the uninterrupted
    run's; the newest complete checkpoint is where the kill was aimed."""
    outcome = _get(played, scenario.name)
    reference = _get(played, f"uninterrupted-{scenario.nproc}")
    for snapshot in outcome.killed:
        assert _problems(snapshot, reference) == [], snapshot.name
        steps = _complete_steps(snapshot)
        if scenario.newest is None:  # killed from outside: after step_2 was committed
            assert steps and steps[-1] >= 2, steps
        else:
            assert steps and steps[-1] == scenario.newest, steps


def _resumed(played, scenario) -> Outcome:
    outcome = _get(played, scenario.name)
    res = outcome.resumed
    if res.returncode != 0:
        raise RunFailed(f"--resume failed (status {res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    found = re.search(r"resumed from \S*step_(\d+)", res.stdout)
    if not (found and int(found[1]) == _complete_steps(outcome.killed[-1])[-1]):
        raise RunFailed(f"--resume did not take the newest complete checkpoint:\n{res.stdout[-2000:]}")
    return outcome


@pytest.mark.parametrize("scenario", SCENARIO_PARAMS)
def test_the_resumed_run_exports_the_uninterrupted_runs_weights_bit_for_bit(played, scenario):
    out = _resumed(played, scenario).out
    reference = _get(played, f"uninterrupted-{scenario.nproc}")
    assert sorted(os.listdir(out / "final")) == sorted(os.listdir(reference / "final"))
    weights = (out / "final" / "model.safetensors").read_bytes()
    assert weights == (reference / "final" / "model.safetensors").read_bytes()
    for name in os.listdir(reference / "final"):
        assert (out / "final" / name).read_bytes() == (reference / "final" / name).read_bytes(), name


@pytest.mark.parametrize("scenario", SCENARIO_PARAMS)
def test_the_resumed_runs_metrics_repeat_the_uninterrupted_runs_step_by_step(played, scenario):
    out = _resumed(played, scenario).out
    reference = _get(played, f"uninterrupted-{scenario.nproc}")
    keys = ("step", "loss", "grad_norm", "lr", "tokens")
    assert [[m[k] for k in keys] for m in _metrics(out)] == [[m[k] for k in keys] for m in _metrics(reference)]


@pytest.mark.parametrize("scenario", SCENARIO_PARAMS)
def test_after_the_resume_every_checkpoint_is_the_uninterrupted_runs(played, scenario):
    """No half-written checkpoint is left, and each one kept holds what the uninterrupted run's does."""
    out = _resumed(played, scenario).out
    reference = _get(played, f"uninterrupted-{scenario.nproc}")
    assert sorted(os.listdir(out / "checkpoints")) == [f"step_{s:08d}" for s in scenario.kept]
    assert _problems(out, reference) == []
