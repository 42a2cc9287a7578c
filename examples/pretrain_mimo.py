#!/usr/bin/env python
"""Train a multimodal LLM with mimo.

    torchrun --nproc-per-node 2 examples/pretrain_mimo.py --config examples/configs/cpu_demo.yaml
    python examples/pretrain_mimo.py --config CONFIG.yaml        # single process, if the layout needs 1 rank

Rank 0 prints one line per step: step, loss, tokens/s, step time, grad norm, TFLOPS/GPU, MFU and memory
(a progress bar instead on an interactive terminal); `--log-json FILE` appends one JSON object per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

# Allow running from a source checkout without installing.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mimo.checkpoint import CheckpointError  # noqa: E402
from mimo.config import ConfigError  # noqa: E402
from mimo.hf import HFWeightsError, check_hf_weights  # noqa: E402
from mimo.runtime import DEVICE_CHOICES  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config (see README: Config reference)")
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                   help="auto: CUDA + NCCL when available, else CPU + gloo")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="override a config field, e.g. --set training.lr=1e-4 (repeatable)")
    p.add_argument("--log-json", metavar="FILE", default=None,
                   help="append one JSON object per step to FILE (same as training.log_json)")
    p.add_argument("--hf-export", default=None, metavar="DIR",
                   help="after training, write the model as a Hugging Face directory (configs with model.hf)")
    p.add_argument("--check", action="store_true",
                   help="check everything a start on WORLD_SIZE ranks checks before its process group (the "
                        "config, the re-plan under training.replan: auto, HF weights, training.load), print "
                        "ok or one error line (exit 2), and write nothing: a launcher runs it before the "
                        "ranks start, so that a requeued job does not loop on an error")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    if "WORLD_SIZE" not in os.environ:  # plain `python`: a one-rank job
        from mimo.runtime.launch import free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    world = int(os.environ["WORLD_SIZE"])

    # Everything about the config is checked before any process group exists.
    try:
        # training.replan: auto takes the planner's layout for `world` ranks when the config's differs.
        from mimo.checkpoint.replan import load_for_world
        from mimo.runtime.device import device_problem, preferred_device_name

        cfg = load_for_world(args.config, args.set, world, preferred_device_name(args.device), rank,
                             int(os.environ.get("LOCAL_WORLD_SIZE", world)), check=args.check)
        from mimo.config.outputs import output_problem
        from mimo.training import layout_problems
        from mimo.training.metrics import missing_packages

        problems = [tuple(p.split(": ", 1)) for p in layout_problems(cfg)] + missing_packages(cfg)
        if args.log_json:
            cfg.training.log_json = args.log_json
            log_problem = output_problem(args.log_json, "file")
            if log_problem:
                problems.append(("--log-json", log_problem))
        device = None if args.check else device_problem(args.device)  # --check may run off the GPU nodes
        if device:
            problems.append(("--device", device))
        if problems:
            raise ConfigError(problems)
        check_hf_weights(cfg)  # HF weights: every tensor present with its shape (headers only)
        if args.hf_export:
            from mimo.hf import hf_modules
            from mimo.training.hf_export import export_problems, out_dir_problem

            problem = export_problems(cfg, hf_modules(cfg))
            if problem:
                raise ConfigError([tuple(problem.split(": ", 1))])
            problem = out_dir_problem(cfg, args.hf_export)
            if problem:
                raise ConfigError([("--hf-export", problem)])
        from mimo.checkpoint import preflight

        # training.load: the manifest, the resume-relevant config fields and the files every rank reads next
        # (--check: every file; a job's ranks check the other files later, each its share, agreed).
        preflight(cfg, every_file=args.check)
    except CheckpointError as exc:
        return _stop(0 if args.check else rank, f"error: {exc}", 2)
    except (ConfigError, HFWeightsError) as exc:
        if rank == 0 or args.check:
            print(str(exc), file=sys.stderr, flush=True)
        else:
            # Every rank finds the same problems; only rank 0 reports them. Give it time to do so
            # before this rank's exit makes torchrun stop the job (rank 0 exiting stops us first).
            import time

            time.sleep(10)
        return 2

    if args.check:
        print("ok", flush=True)
        return 0
    from mimo.checkpoint import checkpointer
    from mimo.data.llava import DataError
    from mimo.data.llava_dataset import MediaError
    from mimo.runtime import init_distributed, select_runtime, setup_megatron, shutdown
    from mimo.training import Trainer
    from mimo.training.agreement import check_same_config
    from mimo.training.metrics import StepReporter

    trainer = None
    try:
        runtime = select_runtime(args.device)
        init_distributed(runtime, cfg.training.timeout_minutes)
        check_same_config(cfg, runtime.device)  # before any group or communicator is built from it
        setup_megatron(runtime, cfg.training.seed)
        trainer = Trainer(cfg, runtime)
        if rank == 0:
            describe(cfg, trainer, runtime)
        ckpt = checkpointer(cfg, trainer, runtime)
        start = ckpt.resume() if ckpt else 0
        if rank == 0 and start:
            print(f"resumed from {cfg.training.load} at step {start}", flush=True)
        if rank == 0 and start >= cfg.training.train_iters:
            print(f"nothing to train: the checkpoint is at step {start} and training.train_iters is "
                  f"{cfg.training.train_iters} (raise it to train on)", flush=True)
        reporter = StepReporter(cfg, trainer, runtime)
        stopped = None
        for step in range(start, cfg.training.train_iters):
            reporter.before_step(step)
            result = trainer.train_step(step)
            reporter.after_step(step, result)
            if ckpt:
                ckpt.after_step(step, stopping=result.stop)
            if result.stop:  # every rank alike: some rank's signal or deadline (training.exit_signal_handler)
                stopped = step + 1
                break
        trainer.close()  # from here a signal ends the process as it would without the handler
        if ckpt:
            ckpt.finish()
        reporter.close()
        if stopped is not None and stopped < cfg.training.train_iters:
            if rank == 0:
                from mimo.checkpoint.paths import iter_dir

                print(f"stopped after step {stopped} ({trainer.stop.reason()}): saved {iter_dir(cfg.training.save, stopped)}"
                      f" (training.load: {cfg.training.save} resumes it)"
                      + ("; no --hf-export, the run is not finished" if args.hf_export else ""), flush=True)
            shutdown()
            return 0
        if args.hf_export:
            from mimo.training.hf_export import export_hf

            export_hf(trainer, args.hf_export)
            if rank == 0:
                print(f"exported to {args.hf_export}", flush=True)
        shutdown()
        return 0
    except CheckpointError as exc:  # found identically on every rank (checked before the collective load)
        _stop(rank, f"error: {exc}", 2)
        os._exit(2)
    except ConfigError as exc:  # the ranks' configs differ: every rank found it in the same reduction
        _stop(rank, str(exc), 2)
        os._exit(2)
    except MediaError as exc:  # every rank after the same step: the ranks that decoded the items name them
        if exc.own or rank == 0:
            print(str(exc), file=sys.stderr, flush=True)
        os._exit(2)
    except DataError as exc:  # e.g. a bad record with on_bad_record: error; every rank meets it when it plans
        if rank != 0:  # the step, but a rank that reads ahead meets it first, while rank 0 may be waiting in
            import time  # a collective: rank 0 reports it; if it does not within 10 s, this rank does.

            time.sleep(10)
        print(str(exc), file=sys.stderr, flush=True)
        _no_restart_fixes(str(exc))
        os._exit(2)
    except Exception as exc:  # one line naming the rank and cause; torchrun then stops the other ranks
        print(f"rank {rank}: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if os.environ.get("MIMO_DEBUG"):
            traceback.print_exc()
        # Exit without waiting on collectives the other ranks will never finish.
        os._exit(1)
    except KeyboardInterrupt:  # Ctrl-C: the run ends mid-step; the finally below ends the data workers
        print(f"rank {rank}: interrupted (SIGINT): the step in progress is not saved; a run stopped by the exit "
              "signal instead (training.exit_signal_handler, SIGTERM) saves its last step", file=sys.stderr, flush=True)
        if os.environ.get("MIMO_DEBUG"):
            traceback.print_exc()
        return 130
    finally:  # reached on a return, or a BaseException (KeyboardInterrupt) on its way out; the os._exit
        # paths above end the process without Python's exit, which would wait forever for data workers
        # that ignore the stop signal (Trainer.close).
        if trainer is not None:
            trainer.close()


def _stop(rank: int, line: str, code: int) -> int:
    """Rank 0 prints the line; the other ranks found the same problem and give it time to do so
    before their exit makes torchrun stop the job."""
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
        _no_restart_fixes(line)
        if os.environ.get("MIMO_DEBUG"):
            traceback.print_exc()
    else:
        import time

        time.sleep(10)
    return code


def _no_restart_fixes(line: str) -> None:
    """An error that a restart would meet again (a checkpoint of another model, a damaged file, a bad
    record): its line goes to the file `MIMO_ERROR_FILE` names, if set. torchrun reports every
    worker's exit as 1, so a launcher script (examples/slurm) reads it there to not requeue the job."""
    path = os.environ.get("MIMO_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                f.write(line.splitlines()[0] + "\n")
        except OSError as exc:  # the error line is on stderr already
            print(f"warning: MIMO_ERROR_FILE: cannot write {path} ({exc.strerror})", file=sys.stderr, flush=True)


def describe(cfg, trainer, runtime) -> None:
    print(f"mimo: {trainer.topo.world_size} ranks on {runtime.device.type} ({runtime.backend})", flush=True)
    for edge in trainer.topo.edges:
        print(f"  edge {edge.src} -> {edge.dst}: {edge.placement}", flush=True)
    from mimo.schedule.plan_build import island_encoders

    island = island_encoders(cfg)
    if island:
        print(f"  note: {', '.join(island)} share ranks with different pp, so those ranks run all forwards of a "
              "step before all backwards (more activation memory; equal pp keeps them on 1F1B)", flush=True)
    for name, grid in trainer.topo.grids.items():
        lay = grid.layout
        held = name in trainer.parts
        n_all = sum(p.numel() for p in trainer.parts[name].parameters()) if held else 0
        n_train = sum(p.numel() for p in trainer.params[name]) if held else 0
        print(f"  {name:10s} ranks [{lay.ranks.start}, {lay.ranks.stop}) tp={lay.tp} cp={lay.cp} pp={lay.pp} "
              f"dp={lay.dp} | on rank 0: params {n_all:,} (trainable {n_train:,})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
