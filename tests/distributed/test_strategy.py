"""TitanStrategy as a Lightning strategy: argument checks at Trainer(...), the drop-in DDP replacement
(torchrun vs Lightning's DDPStrategy launched by script), and fork launch (notebooks)."""

import os
import re
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_titan import TitanStrategy
from lightning_titan.parallel.dp.zero import shard_optimizer
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups
from lightning_titan.runtime import launch
from lightning_titan.runtime.launch import AGENT_STORE, free_port, hosted_rendezvous
from lightning_titan.train.engine import Engine

SCRIPTS = Path(__file__).resolve().parents[1] / "support" / "scripts"


@pytest.mark.parametrize(
    "kwargs,devices,match",
    [
        (
            {"dp": 3, "pp": 1, "ep": 1},
            2,
            r"dp\*pp\*ep\*cp\*tp = 3\*1\*1\*1\*1 = 3 but the world size is 2",
        ),
        ({"dp": 2, "pp": 2, "ep": 2}, 4, "= 8 but the world size is 4"),
        ({"dp": -1, "pp": 3, "ep": 1}, 4, "not divisible"),
        ({"dp": 0}, 2, "dp=0 is not valid"),
        ({"schedule": "interleaved"}, 2, "schedule='interleaved' is unknown"),
        ({"num_microbatches": 0}, 2, "num_microbatches=0 must be a positive int"),
        ({"num_microbatches": 2, "microbatch_size": 2}, 2, "both set"),
        ({"bucket_cap_mb": 0}, 2, "bucket_cap_mb=0 must be > 0"),
        ({"gradient_clip_norm": -1.0}, 2, "gradient_clip_norm=-1.0 must be > 0"),
        ({"timeout_minutes": 0}, 2, "timeout_minutes=0 must be > 0"),
        ({"start_method": "thread"}, 2, "start_method='thread' is unknown"),
        ({"reducer": "ring"}, 2, "reducer='ring' is unknown"),
        ({"zero": 4}, 2, "zero=4 is not a ZeRO level; choose 0"),
        ({"zero": 3, "reducer": "per_param"}, 2, "zero=3 reduce-scatters flat gradient buckets"),
        ({"zero": 2, "reducer": "per_param"}, 2, "zero=2 reduce-scatters flat gradient buckets"),
        ({"virtual_stages": 2}, 2, "virtual_stages=2 needs a schedule over several chunks"),
        (
            {"pp": 2, "schedule": "zbv", "virtual_stages": 1},
            2,
            "virtual_stages=1 does not work; use",
        ),
        ({"stage_layers": [2, -1]}, 2, r"stage_layers=\[2, -1\] must hold ints >= 0"),
        (
            {"ep": 2, "tp": 2, "fold_ep": True, "zero": 3},
            4,
            "fold_ep=True with zero=3 is not built",
        ),
        ({"fold_ep": True, "layout": "auto"}, 2, r"layout='auto' chooses .*fold_ep itself"),
        ({"tp": 2, "fold_ep": "yes"}, 2, "fold_ep='yes' must be true or false"),
    ],
)
def test_bad_arguments_fail_when_the_trainer_is_built(kwargs, devices, match):
    with pytest.raises(ValueError, match=match):
        L.Trainer(
            accelerator="cpu", devices=devices, strategy=TitanStrategy(**kwargs), logger=False
        )


def test_fold_ep_reaches_the_layout():
    """The option the user sets is the layout the model is built from (module.configure_model reads
    ``expert_rank`` / ``expert_world``): ep2 x tp2 folded splits the experts over all 4 ranks."""
    strategy = TitanStrategy(ep=2, tp=2, fold_ep=True)
    L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    dims = strategy.parallel_dims
    assert (dims.dp, dims.fold_ep, dims.expert_world, dims.expert_rank) == (1, True, 4, 0)
    assert dims.label() == "dp=1 pp=1 ep=2 tp=2 fold_ep"


def test_zero_with_nothing_to_split_warns_and_whole_tensor_optimizers_are_refused():
    model = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match=r"zero=1 changes nothing here: .*dp=1, ep=1.*use dp > 1"):
        engine = Engine(model, ParallelDims(1, 1, 1), ProcessGroups(None, None, None, None), zero=1)
    assert engine.zero_groups == []
    # refused by what they do to a probe weight cut in two, not by name: a factored update, an
    # orthogonalised one, a custom g / ||g||, and one that cannot step without a closure
    for optimizer, why in (
        (torch.optim.Adafactor(model.parameters()), "cannot split"),
        (torch.optim.Muon([model.weight]), "cannot split"),
        (UnitStep(model.parameters()), "cannot split"),
        (torch.optim.LBFGS(model.parameters()), "cannot check"),
    ):
        with pytest.raises(ValueError, match=f"zero>0 {why} .*{type(optimizer).__name__}"):
            shard_optimizer(optimizer, [])
    # element-wise ones pass, torch's and a custom one alike
    for optimizer in (
        torch.optim.AdamW(model.parameters(), weight_decay=0.1),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True),
        UnitStep(model.parameters(), elementwise_sign=True),
    ):
        shard_optimizer(optimizer, [])


class UnitStep(torch.optim.Optimizer):
    """A step of length lr along g / ||g|| (whole-tensor), or along sign(g) (element-wise)."""

    def __init__(self, params, lr=0.1, elementwise_sign=False):
        super().__init__(params, dict(lr=lr, elementwise_sign=elementwise_sign))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                d = p.grad.sign() if group["elementwise_sign"] else p.grad / p.grad.norm()
                p.sub_(group["lr"] * d)


@pytest.mark.parametrize("layout", [{"dp": 2, "zero": 1}, {"pp": 2, "dp": 1}])
def test_lightning_clipping_is_refused_where_it_sees_part_of_the_gradient(layout):
    # raised by the launcher's checks, before any rank starts
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=TitanStrategy(**layout),
        gradient_clip_val=0.5, max_steps=1, logger=False, enable_checkpointing=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"gradient_clip_val=0.5\) would clip each rank's part"):
        trainer.fit(BoringModel())


def test_16_mixed_is_rejected_with_the_alternative():
    # on CPU Lightning itself turns 16-mixed into bf16-mixed; on GPU the plugin reaches the strategy
    fp16 = MixedPrecision("16-mixed", "cpu")
    with pytest.raises(ValueError, match="16-mixed.*bf16-mixed"):
        L.Trainer(accelerator="cpu", devices=2, strategy=TitanStrategy(dp=2), plugins=[fp16])
    with pytest.raises(ValueError, match="'16-true' is not supported"):
        L.Trainer(accelerator="cpu", devices=2, strategy=TitanStrategy(dp=2), precision="16-true")


def test_registry_name_and_minus_one_fill():
    trainer = L.Trainer(accelerator="cpu", devices=8, strategy="titan", logger=False)
    assert isinstance(trainer.strategy, TitanStrategy)
    assert (trainer.strategy.parallel_dims.dp, trainer.strategy.parallel_dims.pp) == (8, 1)
    trainer = L.Trainer(
        accelerator="cpu", devices=8, strategy=TitanStrategy(dp=2, pp=-1, ep=2), logger=False
    )
    dims = trainer.strategy.parallel_dims
    assert (dims.dp, dims.pp, dims.ep) == (2, 2, 2)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 0}


def test_the_rendezvous_is_bound_before_any_rank_starts_and_the_environment_is_left_as_found(
    monkeypatch,
):
    """CI failed with EADDRINUSE: a Trainer built in the test process had set MASTER_PORT there, every
    later job it started inherited that one port, and a rank 0 could not bind it. Now the launcher
    binds the store itself, takes the next pick on a clash, names a taken MASTER_PORT, and leaves no
    variable behind."""
    for key in ("MASTER_PORT", AGENT_STORE):
        monkeypatch.delenv(key, raising=False)
    L.Trainer(accelerator="cpu", devices=2, strategy=TitanStrategy(dp=2), logger=False)
    assert "MASTER_PORT" not in os.environ
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([taken, free_port()])
        monkeypatch.setattr(launch, "free_port", lambda: next(picks))
        with hosted_rendezvous() as port:
            assert port != taken
            assert (os.environ["MASTER_PORT"], os.environ[AGENT_STORE]) == (str(port), "True")
            client = dist.TCPStore(
                "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)
            )
            client.set("rank", "0")  # the store serves already
        with pytest.raises(RuntimeError, match=f"MASTER_PORT={taken} is taken .*unset MASTER_PORT"):
            with hosted_rendezvous(taken):
                pass
    assert "MASTER_PORT" not in os.environ and AGENT_STORE not in os.environ


def test_a_forking_launcher_runs_no_store_thread_while_it_forks():
    """A store serves from a thread, and a rank forked while that thread holds a lock deadlocked in
    its own first TCPStore (a probe: 6 of 16 launches of 8 forked ranks; CI's 8-rank fork jobs hung
    at times). Forking, the launcher only binds the port, starts no thread, and rank 0 serves the
    store on the inherited socket."""

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    before = threads()
    with hosted_rendezvous(forks=True) as port:
        assert threads() == before
        assert os.environ[launch.STORE_LAUNCHER] == str(os.getpid())
        assert int(os.environ["MASTER_PORT"]) == port and AGENT_STORE not in os.environ
    assert launch.STORE_FD not in os.environ and launch.STORE_LAUNCHER not in os.environ
    assert launch.run_on_ranks(_rank_and_world, 4, start_method="fork") == [
        (r, 4) for r in range(4)
    ]


def _rank_and_world(rank: int, world_size: int) -> tuple[int, int]:
    dist.barrier()
    return dist.get_rank(), dist.get_world_size()


def test_several_nodes_need_an_agreed_master_port_and_run_on_ranks_takes_master_addr(monkeypatch):
    """popen on num_nodes=2 without MASTER_PORT: each node's launcher would pick a port of its own,
    so the Trainer refuses, saying what to set. run_on_ranks takes MASTER_ADDR from the environment
    (127.0.0.1 when unset)."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match=r"num_nodes=2: set MASTER_PORT .* on every node"):
        L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=TitanStrategy())
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=TitanStrategy())
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert launch.run_on_ranks(_master_addr, 2, start_method="fork") == ["127.0.0.1"] * 2
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert launch.run_on_ranks(_master_addr, 2, start_method="fork") == ["localhost"] * 2


def _master_addr(rank: int, world_size: int) -> str:
    return os.environ["MASTER_ADDR"]


_FIT_VALIDATE_FIT = """
import os
import lightning as L
from lightning_titan import ModelConfig, TitanDataModule, TitanLM, TitanStrategy

config = ModelConfig(d_model=32, n_layers=2, n_experts=4, seq_len=16)
data = TitanDataModule(seq_len=16, global_batch_size=4)


def trainer(**layout):
    return L.Trainer(accelerator="cpu", devices=2, strategy=TitanStrategy(**layout), max_steps=2,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     limit_val_batches=1, num_sanity_val_steps=0, enable_model_summary=False)


def threads():
    return len(os.listdir("/proc/self/task"))


first = trainer(dp=2)
first.fit(TitanLM(config), datamodule=data)
first.validate(first.lightning_module, datamodule=data, verbose=False)
second = trainer(ep=2)  # another layout: new groups, through the first launch's store
second.fit(TitanLM(config), datamodule=data)
after_second = threads()
third = trainer(ep=2)  # the same layout again: the same groups
third.fit(TitanLM(config), datamodule=data)
third.validate(third.lightning_module, datamodule=data, verbose=False)
print(f"rank {third.global_rank} threads {after_second} {threads()}", flush=True)
"""


@pytest.mark.timeout(180)
def test_a_script_fits_validates_and_fits_again_on_the_same_ranks(tmp_path):
    """A script's later launches (this Trainer's validate, then other Trainers' fits) reuse the ranks
    and the world group of the first; the rendezvous store lives on with the group, for the groups
    of a new layout (this failed with EADDRINUSE and 'Broken pipe'); a layout seen before gets the
    same groups (every new gloo group keeps threads polling: the thread count stays put)."""
    script = tmp_path / "fit_validate_fit.py"
    script.write_text(_FIT_VALIDATE_FIT)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, timeout=150,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # the two ranks share stdout: a line of one may run into the other's
    ranks = sorted(re.findall(r"rank (\d) threads (\d+) (\d+)", done.stdout))
    assert [rank for rank, _, _ in ranks] == ["0", "1"], done.stdout
    assert all(before == after for _, before, after in ranks), done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_drop_in_for_ddp_gives_the_same_weights(tmp_path):
    """An ordinary module (automatic optimization, gradient accumulation, an unused layer) under
    TitanStrategy(dp=2, zero=2) launched by torchrun ends with exactly the weights of DDPStrategy
    (script launch): the grads are reduce-scattered, AdamW, the user's own optimizer, updates each
    rank's half of every weight."""
    ours, theirs = tmp_path / "titan.pt", tmp_path / "ddp.pt"
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
    ]
    for cmd in (
        torchrun + [str(SCRIPTS / "dropin.py"), "titan", str(ours)],
        [sys.executable, str(SCRIPTS / "dropin.py"), "ddp", str(theirs)],
    ):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = torch.load(ours), torch.load(theirs)
    assert a["final"].keys() == b["final"].keys()
    for name in a["final"]:
        torch.testing.assert_close(
            a["final"][name], b["final"][name], rtol=1e-6, atol=1e-7, msg=name
        )
    assert not torch.equal(a["final"]["net.0.weight"], a["initial"]["net.0.weight"]), "it trained"
    # the unused layer has no grad under both (None, not zeros), so AdamW's weight decay skips it
    torch.testing.assert_close(a["final"]["unused.weight"], a["initial"]["unused.weight"])


_BACKGROUND_SAVES = """
import os
import sys
from pathlib import Path
import lightning as L
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_titan import ModelConfig, TitanDataModule, TitanLM, TitanStrategy
from lightning_titan.checkpoint import is_complete_checkpoint, latest_complete, read_checkpoint_info
from lightning_titan.lightning.restarts import resumed_call

writes = []
real_save = dcp.save
def counted(*args, **kwargs):
    writes.append(str(kwargs["checkpoint_id"]))
    return real_save(*args, **kwargs)
dcp.save = counted

out, async_save = Path(sys.argv[1]), sys.argv[2] == "async"
config = ModelConfig(d_model=32, n_layers=2, n_experts=4, seq_len=16)

def trainer_of(max_steps):
    strategy = TitanStrategy(async_save=async_save)
    every_step = ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_top_k=1, save_last=True)
    return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps,
                     logger=False, callbacks=[every_step], enable_progress_bar=False,
                     limit_val_batches=0, enable_model_summary=False)

trainer = trainer_of(4)
trainer.fit(TitanLM(config), datamodule=TitanDataModule(seq_len=16, global_batch_size=4))
background = trainer.strategy.checkpoints.background
if async_save:
    print("written in the background", background.seconds > 0, "in flight", background.in_flight)
print("full writes", len(writes), "for 4 events")
names = sorted(p.name for p in out.iterdir())
steps = [read_checkpoint_info(out / n)["meta"]["global_step"] for n in names]
print("after fit", names, [is_complete_checkpoint(out / n) for n in names], steps)
last_meta = read_checkpoint_info(out / "last.ckpt")["meta"]
print("last names itself", last_meta["callbacks"][next(iter(last_meta["callbacks"]))]["last_model_path"])
shards = [n for n in os.listdir(out / "last.ckpt") if n.endswith(".distcp")]
same = [os.stat(out / "last.ckpt" / n).st_ino == os.stat(out / names[0] / n).st_ino for n in shards]
print("last shares the shards", len(shards) > 0 and all(same))
print("newest complete", latest_complete(out).name)
# a restarted rank (no ckpt_path) takes the newest complete checkpoint: `last`
os.environ["TITAN_RESTART_COUNT"] = "1"
resumed = trainer_of(5)
_, kwargs = resumed_call(resumed.fit, (), {}, resumed)
print("restart resumes from", Path(kwargs["ckpt_path"]).name)
del os.environ["TITAN_RESTART_COUNT"]
writes.clear()
resumed.fit(TitanLM(config), datamodule=TitanDataModule(seq_len=16, global_batch_size=4),
            ckpt_path=kwargs["ckpt_path"])
print("resumed to", resumed.global_step, "with full writes", len(writes))
resumed.save_checkpoint(out / "after.ckpt")
print("after save_checkpoint", is_complete_checkpoint(out / "after.ckpt"))
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_one_write_per_checkpoint_event_and_last_resumes(tmp_path, mode):
    """ModelCheckpoint(save_top_k=1, save_last=True, every step) in a real one-process fit: each
    event writes the shards once; `last` is the top-k checkpoint's shard files under a second name
    with a meta.pt of its own. With async_save every save during fit is written in the background
    (the writer timed it), top-k's removals wait for the newer checkpoint, and when fit returns the
    directory holds exactly the newest checkpoint and `last`, complete, at the last step. `last` is
    the newest complete checkpoint: a restart takes it and a resume from it trains on; a save after
    fit is written at once. In a process of its own: a fit leaves its process group behind."""
    script = tmp_path / "background_saves.py"
    script.write_text(_BACKGROUND_SAVES)
    out = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, str(script), str(out), mode], cwd=tmp_path, env=env,
                          timeout=190, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    if mode == "async":
        assert "written in the background True in flight False" in done.stdout, done.stdout
    assert "full writes 4 for 4 events" in done.stdout, done.stdout
    want = "after fit ['epoch=0-step=4.ckpt', 'last.ckpt'] [True, True] [4, 4]"
    assert want in done.stdout, done.stdout
    assert f"last names itself {out / 'last.ckpt'}" in done.stdout, done.stdout
    assert "last shares the shards True" in done.stdout, done.stdout
    assert "newest complete last.ckpt" in done.stdout, done.stdout
    assert "restart resumes from last.ckpt" in done.stdout, done.stdout
    assert "resumed to 5 with full writes 1" in done.stdout, done.stdout
    assert "after save_checkpoint True" in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_automatic_optimization_moves_the_expert_bias_as_one_process(tmp_path):
    """An ordinary module (automatic optimization) around a model with aux-loss-free balancing,
    under TitanStrategy(dp=2): the training step moves the expert biases by the global loads of the
    forwards of Lightning's closure, so weights and biases end as one process training on the
    global batches (each step: both ranks' rows) with the bias update written out here."""
    from scripts.auto_bias import PER_RANK, STEPS, loss_of, new_model, tokens
    from torch.utils.data import DistributedSampler

    from lightning_titan.model.moe.balance import balanced_layers, update_expert_bias
    from lightning_titan.model.moe.layer import take_step_counts

    out = tmp_path / "auto.pt"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "auto_bias.py"), str(out)],
        capture_output=True, text=True, timeout=220, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = torch.load(out)
    model, data = new_model(), tokens()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    # the rows Lightning's DistributedSampler gives each rank (shuffled, seed 0, epoch 0)
    order = [list(DistributedSampler(data, 2, r, shuffle=True, seed=0)) for r in range(2)]
    for step in range(STEPS):
        rows = [data[order[r][step * PER_RANK : (step + 1) * PER_RANK]] for r in range(2)]
        loss_of(model, torch.cat(rows)).backward()
        optimizer.step()
        optimizer.zero_grad()
        update_expert_bias(balanced_layers(model), take_step_counts(model), None)
    # the one process's biases moved (STEPS is odd: an expert's moves cancel only if one step had
    # its load exactly at the mean), so equal biases below are not two zeros
    want_state = model.state_dict()
    biases = [k for k in want_state if k.endswith("expert_bias")]
    assert len(biases) == 2 and all(want_state[k].abs().sum() > 0 for k in biases), "the bias moved"
    for name, want in want_state.items():
        torch.testing.assert_close(
            ours[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
