"""scripts/slurm/train.sbatch under stub `sbatch`, `srun`, `scontrol` and `python` on PATH: the exact commands for
2 nodes x 8 GPUs (rendezvous address, which node runs which torchrun agent, the GPUs each sees, the rollout
placement handed to the driver), hydra overrides passed through unchanged, and the one-line refusals.

The stubs emulate slurm: sbatch sets the job's environment and runs the script; srun runs its task once per node of
--nodelist with SLURM_NODEID / SLURMD_NODENAME and slurm's GPU binding (CUDA_VISIBLE_DEVICES=0..7); python records
what it was started with on which node."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "train.sbatch"

STUBS = {
    "sbatch": r'''
import json, os, subprocess, sys
args = sys.argv[1:]
log(["sbatch"] + args)
i = next(i for i, a in enumerate(args) if not a.startswith("-"))
opts = dict(a[2:].split("=", 1) for a in args[:i] if "=" in a)
hosts = os.environ["STUB_HOSTS"].split(",")[:int(opts.get("nodes", 2))]
env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="stub[" + ",".join(hosts) + "]",
           SLURM_JOB_NUM_NODES=str(len(hosts)), SLURM_GPUS_ON_NODE="8")
if "gpus-per-node" in opts:                     # sbatch's option overrides the header's; 0: a CPU-only job
    env["SLURM_GPUS_PER_NODE"] = opts["gpus-per-node"]
    if opts["gpus-per-node"] == "0":
        del env["SLURM_GPUS_ON_NODE"]
sys.exit(subprocess.run(["bash", args[i]] + args[i + 1:], env=env).returncode)
''',
    "scontrol": r'''
import os, sys
log(["scontrol"] + sys.argv[1:])
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\n".join(sys.argv[3][len("stub["):-1].split(",")))
''',
    "srun": r'''
import os, subprocess, sys
args = sys.argv[1:]
log(["srun"] + args)
i = next(i for i, a in enumerate(args) if not a.startswith("-"))
opts = dict(a[2:].split("=", 1) for a in args[:i] if "=" in a)
for node, host in enumerate(opts["nodelist"].split(",")):
    env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node), SLURMD_NODENAME=host)
    if "SLURM_GPUS_ON_NODE" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = "0,1,2,3,4,5,6,7"
    rc = subprocess.run(args[i:], env=env).returncode
    if rc:
        sys.exit(rc)
''',
    "python": r'''
import os, sys
log(["python@" + os.environ["SLURMD_NODENAME"], "node=" + os.environ["SLURM_NODEID"],
     "CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "")] + sys.argv[1:])
''',
}
PRELUDE = '''
def log(argv):
    import json, os
    with open(os.environ["STUB_LOG"], "a") as f:
        f.write(json.dumps(argv) + "\\n")
'''


@pytest.fixture
def slurm(tmp_path):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in STUBS.items():
        f = stubs / name
        f.write_text(f"#!{sys.executable}\n{PRELUDE}{body}")
        f.chmod(0o755)
    log = tmp_path / "log.jsonl"

    def submit(*args, hosts="gpu01,gpu02,gpu03"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        env.update(PATH=f"{stubs}:{os.environ['PATH']}", STUB_LOG=str(log), STUB_HOSTS=hosts)
        log.write_text("")
        proc = subprocess.run(["sbatch", *args], env=env, capture_output=True, text=True, timeout=60)
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        return proc, calls
    return submit


RUN = ["python", "-m", "torch.distributed.run"]
RDZV = ["--rdzv-backend=c10d", "--rdzv-endpoint=gpu01:29500", "--rdzv-id=moe_lora_rl-4242", "--max-restarts=0"]
OVERRIDES = ["steps=100", "layout.tp=2", "layout.ep=4", "data.train_file=/data/my train.parquet"]


def test_two_nodes_rollout_on_own_gpus(slurm):
    """2 nodes x 8 GPUs, the engine on GPUs 6,7 of the first node: both nodes train on GPUs 0-5 (2 x 6 ranks)."""
    proc, calls = slurm("--nodes=2", str(SCRIPT), "--rollout=gpus", "--rollout-gpus=2", *OVERRIDES)
    assert proc.returncode == 0, proc.stderr
    train = ["-m", "moe_lora_rl.train", "rollout.node=gpu01", "rollout.gpus=[6,7]", *OVERRIDES]
    agent = RUN[1:] + ["--nnodes=2", "--nproc-per-node=6", *RDZV, *train]
    assert calls == [
        ["sbatch", "--nodes=2", str(SCRIPT), "--rollout=gpus", "--rollout-gpus=2", *OVERRIDES],
        ["scontrol", "show", "hostnames", "stub[gpu01,gpu02]"],
        ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=gpu01,gpu02", "--kill-on-bad-exit=1",
         "env", "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5", *RUN, "--nnodes=2", "--nproc-per-node=6", *RDZV, *train],
        ["python@gpu01", "node=0", "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5", *agent],
        ["python@gpu02", "node=1", "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5", *agent],
    ], calls
    assert "rollout engine on gpu01 GPUs [6,7]" in proc.stdout


def test_two_nodes_rollout_on_own_node(slurm):
    """2 nodes x 8 GPUs, the engine on the second node: one training node of 8 ranks, all 8 GPUs of gpu02 to it."""
    proc, calls = slurm("--nodes=2", str(SCRIPT), *OVERRIDES)
    assert proc.returncode == 0, proc.stderr
    train = ["-m", "moe_lora_rl.train", "rollout.node=gpu02", "rollout.gpus=[0,1,2,3,4,5,6,7]", *OVERRIDES]
    assert calls[2:] == [
        ["srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--nodelist=gpu01", "--kill-on-bad-exit=1",
         *RUN, "--nnodes=1", "--nproc-per-node=8", *RDZV, *train],
        ["python@gpu01", "node=0", "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7", *RUN[1:], "--nnodes=1",
         "--nproc-per-node=8", *RDZV, *train],
    ], calls


def test_two_training_nodes_plus_rollout_node(slurm):
    """3 nodes: 2 training nodes x 8 GPUs on one rendezvous at the first, the engine on 4 GPUs of the third."""
    proc, calls = slurm("--nodes=3", str(SCRIPT), "--rollout-gpus=4", "--rdzv-port=29611", "--", *OVERRIDES)
    assert proc.returncode == 0, proc.stderr
    rdzv = [a.replace("29500", "29611") for a in RDZV]
    train = ["-m", "moe_lora_rl.train", "rollout.node=gpu03", "rollout.gpus=[0,1,2,3]", *OVERRIDES]
    agent = ["--nnodes=2", "--nproc-per-node=8", *rdzv, *train]
    assert calls[2:] == [
        ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=gpu01,gpu02", "--kill-on-bad-exit=1",
         *RUN, *agent],
        ["python@gpu01", "node=0", "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7", *RUN[1:], *agent],
        ["python@gpu02", "node=1", "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7", *RUN[1:], *agent],
    ], calls


def test_cpu_nodes_ask_for_no_gpus(slurm):
    """A CPU-only job (sbatch --gpus-per-node=0 overrides the header's 8): ranks per node from --nproc-per-node, no
    device binding, the engine on the second node with rollout.gpus=[] (its srun then asks for no GPU:
    rollout/placement.py); with --rollout=gpus the engine stays on the first node, every node trains."""
    proc, calls = slurm("--nodes=2", "--gpus-per-node=0", str(SCRIPT), "--nproc-per-node=2", "--rollout-gpus=0",
                        "steps=3")
    assert proc.returncode == 0, proc.stderr
    train = ["-m", "moe_lora_rl.train", "rollout.node=gpu02", "rollout.gpus=[]", "steps=3"]
    agent = ["--nnodes=1", "--nproc-per-node=2", *RDZV, *train]
    assert calls[2:] == [
        ["srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--nodelist=gpu01", "--kill-on-bad-exit=1",
         *RUN, *agent],
        ["python@gpu01", "node=0", "CUDA_VISIBLE_DEVICES=", *RUN[1:], *agent],
    ], calls
    proc, calls = slurm("--nodes=2", "--gpus-per-node=0", str(SCRIPT), "--nproc-per-node=2", "--rollout=node",
                        "steps=3")                      # R defaults to the node's GPUs: none
    assert proc.returncode == 0 and "rollout.gpus=[]" in calls[2], proc.stderr
    proc, calls = slurm("--nodes=2", "--gpus-per-node=0", str(SCRIPT), "--nproc-per-node=2", "--rollout=gpus",
                        "steps=3")
    assert proc.returncode == 0, proc.stderr
    assert calls[2][:6] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=gpu01,gpu02",
                            "--kill-on-bad-exit=1"] and "env" not in calls[2], calls
    assert calls[2][-3:] == ["rollout.node=gpu01", "rollout.gpus=[]", "steps=3"] and "--nproc-per-node=2" in calls[2]


def test_fewer_ranks_than_gpus(slurm):
    """--nproc-per-node below the node's training GPUs: --rollout=gpus binds GPUs 0..P-1 and the engine keeps the
    last R GPUs (not those after the ranks)."""
    proc, calls = slurm("--nodes=1", str(SCRIPT), "--rollout=gpus", "--rollout-gpus=2", "--nproc-per-node=4", "steps=3")
    assert proc.returncode == 0, proc.stderr
    assert calls[-1][:3] == ["python@gpu01", "node=0", "CUDA_VISIBLE_DEVICES=0,1,2,3"], calls
    assert "--nproc-per-node=4" in calls[-1] and calls[-1][-3:] == ["rollout.node=gpu01", "rollout.gpus=[6,7]",
                                                                    "steps=3"]


def test_dry_run_runs_nothing(slurm):
    proc, calls = slurm("--nodes=2", str(SCRIPT), "--dry-run", "--gpus-per-node=4", "steps=3")
    assert proc.returncode == 0, proc.stderr
    assert [c[0] for c in calls] == ["sbatch", "scontrol"]
    assert "--nproc-per-node=4" in proc.stdout and "rollout.gpus=\\[0\\,1\\,2\\,3\\]" in proc.stdout


def test_max_restarts_resume_by_themselves(slurm):
    """--max-restarts=K reaches torchrun, and the run gets resume=auto unless the user chose a resume= value."""
    proc, calls = slurm("--nodes=2", str(SCRIPT), "--max-restarts=3", "steps=3", "checkpoint_every=1")
    assert proc.returncode == 0, proc.stderr
    srun = calls[2]
    assert "--max-restarts=3" in srun and srun[-3:] == ["steps=3", "checkpoint_every=1", "resume=auto"], srun
    proc, calls = slurm("--nodes=2", str(SCRIPT), "--max-restarts=1", "resume=true", "checkpoint_every=1")
    assert calls[2][-2:] == ["resume=true", "checkpoint_every=1"] and "resume=auto" not in calls[2]
    proc, calls = slurm("--nodes=2", str(SCRIPT), "steps=3")
    assert "--max-restarts=0" in calls[2] and "resume=auto" not in calls[2]     # the default: no restarts


@pytest.mark.parametrize("args,nodes,msg", [
    (["--max-restarts=-1"], 2, "--max-restarts=-1 must be an integer >= 0"),
    (["--rollout=gpus", "--rollout-gpus=8"], 2, "--rollout-gpus=8 < --gpus-per-node=8"),
    (["--rollout-gpus=9"], 2, "--rollout-gpus=9 exceeds --gpus-per-node=8"),
    ([], 1, "--rollout=node needs at least 2 nodes"),
    (["--rollout=remote"], 2, "--rollout=remote: choose node or gpus"),
    (["--gpus-per-node=-1"], 2, "--gpus-per-node=-1 must be an integer >= 0"),
    (["--gpus-per-node=0"], 2, "the nodes have no GPUs (--gpus-per-node=0): give the training ranks per node with "
                               "--nproc-per-node=P"),
    (["--nproc-per-node=0"], 2, "--nproc-per-node=0 must be an integer >= 1"),
    (["--rollout=gpus", "--rollout-gpus=2", "--nproc-per-node=7"], 2,
     "--nproc-per-node=7 exceeds the 6 training GPUs a node"),
    (["--gpus-per-node=0", "--nproc-per-node=2", "--rollout-gpus=1"], 2, "--rollout-gpus=1 exceeds --gpus-per-node=0"),
    (["--gpus-per-node=0", "--nproc-per-node=2", "--rollout=gpus", "--rollout-gpus=1"], 2,
     "--rollout=gpus needs --rollout-gpus=1 < --gpus-per-node=0"),
    (["--rdzv-port=x"], 2, "--rdzv-port=x must be an integer"),
    (["--nproc=3"], 2, "unknown option --nproc"),
])
def test_refusals(slurm, args, nodes, msg):
    proc, calls = slurm(f"--nodes={nodes}", str(SCRIPT), *args, "steps=3")
    assert proc.returncode == 2 and msg in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "srun" not in [c[0] for c in calls]


def test_outside_an_allocation(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    proc = subprocess.run(["bash", str(SCRIPT), "steps=3"], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "not inside a slurm allocation" in proc.stderr


def test_help():
    proc = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "--rollout=gpus" in proc.stdout and "c10d" in proc.stdout


LOCAL = SCRIPT.parent / "local_cluster.sh"


@pytest.mark.parametrize("args,msg", [
    ([], "unknown action '': choose start or stop"),
    (["begin"], "unknown action 'begin': choose start or stop"),
    (["start", "--gpus=two"], "--gpus=two must be an integer >= 0"),
    (["start", "--port=80"], "--port=80 must be an integer in 1024..65000"),
    (["stop", "--nodes=3"], "unknown argument --nodes=3"),
])
def test_local_cluster_refusals(args, msg):
    """scripts/slurm/local_cluster.sh refuses before it starts or writes anything (tests/cluster runs it)."""
    proc = subprocess.run(["bash", str(LOCAL), *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and msg in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
