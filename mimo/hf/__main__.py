"""`python -m mimo.hf export --config FILE.yaml [--load CKPT_DIR] --out DIR`.

Starts the ranks the config's layout needs (CPU, gloo), builds the model with
its weights from the config's HF directory (or, with `--load`, from a mimo
checkpoint: weights only, restored at the config's layout), and writes an HF
directory that transformers loads (LlavaForConditionalGeneration for model.hf).
Exit 2 with one `error:` line for bad input.
"""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mimo.hf")
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="write the model as a Hugging Face directory")
    exp.add_argument("--config", required=True)
    exp.add_argument("--load", default=None, metavar="CKPT_DIR",
                     help="a mimo checkpoint to export instead of the config's HF weights")
    exp.add_argument("--out", required=True)
    exp.add_argument("--set", action="append", default=[], metavar="PATH=VALUE")
    args = parser.parse_args(argv)

    from mimo.config import ConfigError, apply_overrides, load_config, read_yaml, without_data

    from . import HFWeightsError, check_hf_weights

    from mimo.checkpoint import CheckpointError
    from mimo.runtime import RankFailed

    try:
        # The model only: a training config's data (records, tokenizer) need not exist here.
        raw = without_data(apply_overrides(read_yaml(args.config), args.set))
        check_hf_weights(load_config(raw))
        # The launcher sits above the training layer it starts.
        from mimo.training.hf_export import export_config

        ckpt = export_config(raw, args.out, load=args.load)
    except CheckpointError as exc:  # --load: missing, damaged, or another architecture than the config's
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ConfigError, HFWeightsError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RankFailed, OSError) as exc:  # the export itself failed (a rank, the disk): not bad input
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}" + (f" (weights of {ckpt})" if ckpt else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
