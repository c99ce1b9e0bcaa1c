"""AdaLossScaler under the trainers fp16 users run (HF Accelerate and Trainer, Lightning and
Fabric), tiny HF GPT2 on CPU.

Each trainer takes the scaler where it takes a ``GradScaler``; the tests pin that the trainer's own
loop (accumulation, clipping after ``unscale_``, checkpoints) gives what a hand-written
AdaLossScaler loop gives, and that a skipped step is seen where the trainer looks for one.
Accelerate turns native fp16 off on CPU, so its GPU path is emulated (``native_amp = True``:
the same autocast and scaler calls it makes on a GPU).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import torch_bridge
from adaloss_zoo import torch_zoo as tz

accelerate = pytest.importorskip("accelerate")

ACCUM = 2  # micro-batches per optimizer step
CLIP = 1.0


def _model() -> torch.nn.Module:
    model, _ = tz.CASES["hf-gpt2"].build(0)
    for m in model.modules():  # no dropout, also where a trainer calls model.train()
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def _batches(n: int) -> list[torch.Tensor]:
    return [tz._tokens(10 + i, batch=2) for i in range(n)]


def _lm_loss(model: torch.nn.Module, ids: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss * factor


def _optim(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)


def _hand_loop(batches: list[torch.Tensor], factors: list[float]) -> tuple[torch.nn.Module, list[float]]:
    """The reference: a plain loop with the scaler, as the scaler's docs write it."""
    model = _model()
    opt, sched = _optim(model)
    scaler = torch_bridge.AdaLossScaler(model)
    for k in range(0, len(batches), ACCUM):
        for ids, f in zip(batches[k:k + ACCUM], factors[k:k + ACCUM]):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _lm_loss(model, ids, f)
            scaler.scale(loss.float() / ACCUM).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        if not scaler.last_step_skipped:
            sched.step()
        opt.zero_grad()
    return model, sched.get_last_lr()


def _accelerate_loop(batches: list[torch.Tensor], factors: list[float], save: str | None = None,
                     load: str | None = None) -> tuple[torch.nn.Module, Any, list[bool], Any]:
    """The recipe: the scaler set as ``accelerator.scaler`` before ``prepare()``."""
    from accelerate import Accelerator

    model = _model()
    opt, sched = _optim(model)
    acc = Accelerator(mixed_precision="fp16", gradient_accumulation_steps=ACCUM, cpu=True)
    acc.native_amp = True  # emulates the GPU path (Accelerate turns native fp16 off on CPU)
    acc.scaler = torch_bridge.AdaLossScaler(model)
    model, opt, sched = acc.prepare(model, opt, sched)
    if load is not None:
        acc.load_state(load)
    skipped = []
    for ids, f in zip(batches, factors):
        with acc.accumulate(model):
            acc.backward(_lm_loss(model, ids, f))
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            sched.step()
            opt.zero_grad()
            if acc.sync_gradients:
                skipped.append(acc.optimizer_step_was_skipped)
    if save is not None:
        acc.save_state(save)
    return model, sched.get_last_lr(), skipped, acc.scaler


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa = dict(a.named_parameters())
    return all(torch.equal(p, pa[n]) for n, p in b.named_parameters())


def test_accelerate_recipe_trains_as_the_hand_written_loop_and_sees_a_skipped_step(tmp_path):
    batches = _batches(3 * ACCUM)
    factors = [1.0] * len(batches)
    factors[2 * ACCUM] = math.nan  # the third optimizer step's first micro-batch
    ref, ref_lr = _hand_loop(batches, factors)
    model, lr, skipped, scaler = _accelerate_loop(batches, factors, save=str(tmp_path / "ckpt"))
    assert skipped == [False, False, True]
    assert scaler.skipped_steps == 1 and scaler.last_step_skipped
    assert lr == ref_lr == [1e-3 * 0.5**2]  # the scheduler did not step on the skipped step
    assert _same_params(ref, model)
    # resume through Accelerate's own checkpoint: the scaler's state comes back
    _, _, _, resumed = _accelerate_loop([], [], load=str(tmp_path / "ckpt"))
    assert resumed.iteration == scaler.iteration == 3
    assert resumed.skipped_steps == 1 and resumed.backoff == scaler.backoff == 1


def _lightning_run(batches: list[torch.Tensor], factors: list[float], steps: int,
                   hold_scheduler: bool = True, ckpt: Any = None) -> tuple[torch.nn.Module, Any, Any]:
    """The recipe: ``MixedPrecision("16-mixed", ..., scaler=AdaLossScaler(module))``; the
    scheduler held on a skipped step by ``lr_scheduler_step`` reading ``last_step_skipped``."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            ids, f = batch
            return _lm_loss(self.net, ids, float(f)).float()

        def configure_optimizers(self) -> Any:
            opt, sched = _optim(self.net)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
            if not (hold_scheduler and scaler.last_step_skipped):
                scheduler.step()

    module = LM()
    scaler = torch_bridge.AdaLossScaler(module)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=ACCUM,
                         gradient_clip_val=CLIP, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    data = torch.utils.data.DataLoader(list(zip(batches, factors)), batch_size=None)
    trainer.fit(module, data, ckpt_path=ckpt)
    return module.net, trainer, scaler


def test_lightning_recipe_trains_as_the_hand_written_loop_and_holds_the_scheduler_on_a_skip(tmp_path):
    pytest.importorskip("lightning")
    batches = _batches(3 * ACCUM)
    factors = [1.0] * len(batches)
    factors[2 * ACCUM] = math.nan
    ref, ref_lr = _hand_loop(batches, factors)
    model, trainer, scaler = _lightning_run(batches, factors, steps=3)
    assert scaler.skipped_steps == 1 and scaler.last_step_skipped
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr() == ref_lr == [1e-3 * 0.5**2]
    assert _same_params(ref, model)
    # resume through Lightning's checkpoint (it carries the precision plugin's state_dict)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    _, _, resumed = _lightning_run(batches, factors, steps=3, ckpt=tmp_path / "last.ckpt")
    assert resumed is not scaler and resumed.iteration == 3 and resumed.skipped_steps == 1
    assert resumed.backoff == 1


def test_hf_trainer_recipe_trains_as_the_hand_written_loop_and_holds_the_scheduler_on_a_skip(tmp_path):
    """The recipe: a ``Trainer`` subclass that installs the scaler on the Accelerator it builds
    (before ``train()`` prepares the model and optimizer)."""
    from transformers import Trainer, TrainingArguments

    batches = _batches(3 * ACCUM)
    factors = [1.0] * len(batches)
    factors[2 * ACCUM] = math.nan
    ref, ref_lr = _hand_loop(batches, factors)

    class AdaLossTrainer(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            self.accelerator.native_amp = True  # emulates the GPU path, as above
            self.accelerator.scaler = torch_bridge.AdaLossScaler(self.model)

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:  # the hand loop's order
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            return _lm_loss(model, inputs["input_ids"], inputs["factor"])

    data = [{"input_ids": ids, "factor": f} for ids, f in zip(batches, factors)]
    args = TrainingArguments(str(tmp_path), fp16=True, use_cpu=True, per_device_train_batch_size=1,
                             gradient_accumulation_steps=ACCUM, max_steps=3, max_grad_norm=CLIP,
                             report_to=[], save_strategy="steps", save_steps=3, remove_unused_columns=False,
                             disable_tqdm=True, logging_strategy="no")

    def trainer() -> tuple[torch.nn.Module, Any, Any]:
        model = _model()
        opt, sched = _optim(model)
        return model, sched, AdaLossTrainer(
            model=model, args=args, train_dataset=data, optimizers=(opt, sched),
            data_collator=lambda rows: {"input_ids": rows[0]["input_ids"], "factor": rows[0]["factor"]})

    model, sched, first = trainer()
    first.train()
    scaler = first.accelerator.scaler
    assert scaler.iteration == 3 and scaler.skipped_steps == 1
    assert sched.get_last_lr() == ref_lr == [1e-3 * 0.5**2]
    assert _same_params(ref, model)
    # resume from the Trainer's own checkpoint (scaler.pt): the scaler's state comes back
    _, _, second = trainer()
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    resumed = second.accelerator.scaler
    assert resumed is not scaler and resumed.iteration == 3 and resumed.skipped_steps == 1
    assert resumed.backoff == 1


def test_fabric_recipe_trains_as_the_hand_written_loop_and_checkpoints_the_scaler(tmp_path):
    """Fabric: the precision plugin takes the scaler; ``fabric.save``/``load`` carry it as any
    object with a ``state_dict``."""
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision

    batches = _batches(3 * ACCUM)
    factors = [1.0] * len(batches)
    factors[2 * ACCUM] = math.nan
    ref, ref_lr = _hand_loop(batches, factors)

    def run(load: bool) -> tuple[torch.nn.Module, Any, Any]:
        model = _model()
        scaler = torch_bridge.AdaLossScaler(model)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        opt, sched = _optim(model)
        wrapped, opt = fabric.setup(model, opt)
        state = {"model": wrapped, "optimizer": opt, "scaler": scaler}
        if load:
            fabric.load(tmp_path / "ckpt", state)
            return model, sched, scaler
        for k in range(0, len(batches), ACCUM):
            for ids, f in zip(batches[k:k + ACCUM], factors[k:k + ACCUM]):
                fabric.backward(_lm_loss(wrapped, ids, f) / ACCUM)
            # a skipped step's norm is inf, as with GradScaler: clip without raising
            fabric.clip_gradients(wrapped, opt, max_norm=CLIP, error_if_nonfinite=False)
            opt.step()
            if not scaler.last_step_skipped:
                sched.step()
            opt.zero_grad()
        fabric.save(tmp_path / "ckpt", state)
        return model, sched, scaler

    model, sched, scaler = run(load=False)
    assert scaler.skipped_steps == 1 and sched.get_last_lr() == ref_lr == [1e-3 * 0.5**2]
    assert _same_params(ref, model)
    restored, _, resumed = run(load=True)
    assert resumed.iteration == 3 and resumed.skipped_steps == 1 and resumed.backoff == 1
    assert _same_params(ref, restored)
