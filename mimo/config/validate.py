"""Semantic checks on a loaded config. Pure Python: runs before any process group.

Each rule appends `(dotted.path, reason)`; nothing stops at the first problem.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

from .hf_files import processor_dir, tokenizer_dir
from .kernel import field_problems, resolve_problem
from .load import Problem
from .outputs import output_problem
from .schema import (
    ATTENTION_KINDS,
    BAD_RECORD_MODES,
    BALANCE_POLICIES,
    DATA_KINDS,
    CP_POLICIES,
    ENCODER_KINDS,
    INIT_MODES,
    LANGUAGE,
    LLM_POSITION_EMBEDDINGS,
    LR_DECAY_STYLES,
    max_placeholder_count,
    OPTIMIZERS,
    PRECISIONS,
    PROJECTOR_KINDS,
    ACTIVATIONS,
    AUDIO_FRONTENDS,
    NORMALIZATIONS,
    RESOLUTIONS,
    VISION_POSITION_EMBEDDINGS,
    RECOMPUTE_KINDS,
    MOE_DISPATCHERS,
    MODALITY_ATTENTION,
    REPLAN_MODES,
    EncoderConfig,
    LanguageConfig,
    MimoConfig,
    ParallelConfig,
)


def placement(a: ParallelConfig, b: ParallelConfig) -> str:
    """`colocated` (same ranks), `non-colocated` (disjoint) or `overlap` (invalid)."""
    ra, rb = set(a.ranks), set(b.ranks)
    if ra == rb:
        return "colocated"
    if ra.isdisjoint(rb):
        return "non-colocated"
    return "overlap"


def is_homogeneous(cfg: MimoConfig) -> bool:
    """Whether the step plan is of the homogeneous family (every module on the language's layout, one
    forward and backward through all modules per microbatch: `mimo.schedule.plan_build`)."""
    return _homogeneous(cfg.parallelism, bool(cfg.model.encoders))


def _homogeneous(parallelism: Dict[str, ParallelConfig], has_encoders: bool) -> bool:
    lang = parallelism[LANGUAGE]
    # The LLM's ep / etp re-divide its own ranks (docs/moe.md): not part of the dense layout compared here.
    shape = lambda p: (p.tp, p.cp, p.pp, p.dp, p.rank_offset)  # noqa: E731
    same = all(shape(p) == shape(lang) for p in parallelism.values())
    return same and (not has_encoders or (lang.pp == 1 and lang.cp == 1))


def offload_problem(parallelism: Dict[str, ParallelConfig], encoders: Sequence[str]) -> Optional[str]:
    """Why `training.offload_encoders` would have no effect on this layout, or None. It moves colocated
    encoders' weights off the device while the LLM runs alone (phase 2 of the three-phase plan): a
    layout without that phase would ignore it."""
    lang = parallelism[LANGUAGE]
    if not any(placement(parallelism[n], lang) == "colocated" for n in encoders):
        return "needs an encoder colocated with the LLM (on the LLM's ranks); here none is"
    if _homogeneous(parallelism, bool(encoders)):
        return ("has no effect when every module has the LLM's layout (the encoders run in every microbatch, "
                "never idle): give the colocated encoders their own tp / dp, or leave it out")
    return None


def validate(cfg: MimoConfig, world_size: Optional[int] = None) -> List[Problem]:
    # A NaN or infinite number is reported once, as such: the range checks below would only repeat it.
    nonfinite = _nonfinite_floats(cfg)
    problems: List[Problem] = [(path, f"must be a finite number, got {v}") for path, v in nonfinite.items()]
    add = lambda path, reason: path in nonfinite or problems.append((path, reason))  # noqa: E731

    _positive_ints(cfg, add)
    lang = cfg.model.language
    _check_choice(lang.attention, ATTENTION_KINDS, "model.language.attention", add)
    _check_heads(lang, "model.language", add)
    if isinstance(lang.num_query_groups, int) and lang.num_query_groups > 0 and lang.num_attention_heads % lang.num_query_groups:
        add("model.language.num_query_groups", f"must divide num_attention_heads ({lang.num_attention_heads})")
    for i, name in enumerate(lang.text_sees or []):
        if name not in cfg.model.encoders:
            add(f"model.language.text_sees[{i}]", f"no such encoder {name!r}")
    if lang.text_sees is not None and lang.attention != "bitfield":
        add("model.language.text_sees", "only takes effect with model.language.attention: bitfield")
    _check_choice(lang.modality_attention, MODALITY_ATTENTION, "model.language.modality_attention", add)
    if lang.text_sees is not None and lang.modality_attention == "causal":
        add("model.language.text_sees", "needs model.language.modality_attention: bidirectional "
                                        "(with causal, every token sees every earlier one)")
    _check_attention_kernel(lang, "model.language", add)
    _check_choice(lang.cp_policy, CP_POLICIES, "model.language.cp_policy", add)
    _check_choice(lang.normalization, NORMALIZATIONS, "model.language.normalization", add)
    _check_choice(lang.activation, ACTIVATIONS, "model.language.activation", add)
    for key in ("norm_eps", "rope_theta"):
        _positive(getattr(lang, key), f"model.language.{key}", add)
    if lang.rope_scaling is not None:
        keys = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
        if not isinstance(lang.rope_scaling, dict) or set(lang.rope_scaling) != keys:
            add("model.language.rope_scaling", f"must have exactly the keys {', '.join(sorted(keys))}")
        else:
            for key in sorted(keys):
                _positive(lang.rope_scaling[key], f"model.language.rope_scaling.{key}", add)
            low, high = lang.rope_scaling["low_freq_factor"], lang.rope_scaling["high_freq_factor"]
            if _number(low) and _number(high) and not high > low:  # Llama 3 divides by their difference
                add("model.language.rope_scaling.high_freq_factor", f"must be > low_freq_factor ({low}), got {high}")
    _check_mrope(lang, add)
    _check_moe(lang, add)
    if cfg.data.seq_length > lang.max_sequence_length:
        add("data.seq_length", f"must be <= model.language.max_sequence_length ({lang.max_sequence_length})")
    if lang.position_embedding == "mrope" and lang.rope_scaling is not None:
        # M-RoPE rotates with plain frequencies (Qwen2-VL): no Llama-3 rescaling of them.
        add("model.language.rope_scaling", "is not supported with position_embedding: mrope")

    for name, enc in cfg.model.encoders.items():
        path = f"model.encoders.{name}"
        if name == LANGUAGE:
            add(path, f"'{LANGUAGE}' is reserved for the LLM; rename the encoder")
        _check_encoder(enc, path, add)
        if enc.kind in ENCODER_KINDS and _tokens_ok(enc) and enc.tokens_per_item >= cfg.data.seq_length:
            add(path, f"one item is {enc.tokens_per_item} tokens, which does not fit in data.seq_length ({cfg.data.seq_length})")
        if _native(enc) and _native_sizes_ok(enc):
            _check_native_fits(enc, path, cfg.data.seq_length, add)

    _check_placeholders(cfg, add)
    trainable = not lang.frozen or any(not e.frozen or not e.projector.frozen for e in cfg.model.encoders.values())
    if not trainable:
        add("model", "every module is frozen: nothing would be trained")

    _check_choice(cfg.data.kind, DATA_KINDS, "data.kind", add)
    _check_data(cfg, add)
    _check_balance(cfg, add)
    tr = cfg.training
    _check_choice(tr.optimizer, OPTIMIZERS, "training.optimizer", add)
    _check_choice(tr.precision, PRECISIONS, "training.precision", add)
    _check_choice(tr.init, INIT_MODES, "training.init", add)
    if not tr.lr > 0:
        add("training.lr", f"must be > 0, got {tr.lr}")
    if tr.weight_decay < 0:
        add("training.weight_decay", "must be >= 0")
    if tr.clip_grad < 0:
        add("training.clip_grad", "must be >= 0 (0 disables clipping)")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(tr, name) < 1:
            add(f"training.{name}", f"must be in [0, 1), got {getattr(tr, name)}")
    if not tr.adam_eps > 0:
        add("training.adam_eps", f"must be > 0, got {tr.adam_eps}")
    _check_schedule(tr, add)
    if not tr.timeout_minutes > 0:
        add("training.timeout_minutes", "must be > 0")
    if tr.peak_tflops is not None and not tr.peak_tflops > 0:
        add("training.peak_tflops", f"must be > 0, got {tr.peak_tflops}")
    if tr.timeline is not None and isinstance(tr.timeline_step, int) and tr.timeline_step > tr.train_iters:
        add("training.timeline_step", f"step {tr.timeline_step} is after the last step (train_iters = {tr.train_iters})")
    _check_checkpoints(tr, add)
    _check_replan(cfg, add)
    for key in ("log_json", "tensorboard_dir", "wandb_project", "timeline", "save", "load"):
        if getattr(tr, key) == "":
            add(f"training.{key}", "must not be empty (leave the field out to disable it)")
    for key, kind in (("log_json", "file"), ("timeline", "file"), ("tensorboard_dir", "directory")):
        problem = output_problem(getattr(tr, key), kind) if getattr(tr, key) else ""
        if problem:
            add(f"training.{key}", problem)

    _check_parallelism(cfg, world_size, add)
    return problems


def _check_mrope(lang: LanguageConfig, add) -> None:
    """M-RoPE splits the rotary half of each head (head_dim / 2 frequencies) into time, height and
    width parts: three sizes that must add up to it."""
    path = "model.language"
    _check_choice(lang.position_embedding, LLM_POSITION_EMBEDDINGS, f"{path}.position_embedding", add)
    section = lang.mrope_section
    if lang.position_embedding != "mrope":
        if section is not None:
            add(f"{path}.mrope_section", "only takes effect with model.language.position_embedding: mrope")
        return
    if section is None:
        add(f"{path}.mrope_section", "is required with position_embedding: mrope (e.g. [16, 24, 24])")
        return
    if (not isinstance(section, (list, tuple)) or len(section) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in section)):
        add(f"{path}.mrope_section", f"must be three positive integers (time, height, width), got {section!r}")
        return
    if isinstance(lang.hidden_size, int) and isinstance(lang.num_attention_heads, int) and lang.num_attention_heads > 0:
        head_dim = lang.kv_channels or lang.hidden_size // lang.num_attention_heads
        if sum(section) * 2 != head_dim:
            add(f"{path}.mrope_section", f"must add up to head_dim / 2 = {head_dim // 2}, got {sum(section)}")


def _check_balance(cfg: MimoConfig, add) -> None:
    """`entrain` defers LLM work to a later pipelined microbatch: it needs a pipeline."""
    path, policy = "data.balance", cfg.data.balance
    if policy not in BALANCE_POLICIES:
        _check_choice(policy, BALANCE_POLICIES, path, add)
        return
    if policy != "entrain":
        return
    lang = cfg.parallelism.get(LANGUAGE, ParallelConfig())
    remote = [n for n in cfg.model.encoders
              if n in cfg.parallelism and placement(cfg.parallelism[n], lang) == "non-colocated"]
    if lang.pp < 2 and not remote:
        add(path, "entrain defers LLM work between pipelined microbatches, but the layout has no pipeline "
                  "(parallelism.language.pp = 1 and no non-colocated encoder); use mmscale or none")


def _check_image_processor(cfg: MimoConfig, name: str, add) -> None:
    """The HF image processor the data pipeline will use for encoder `name` (if any) must make
    images of the encoder's size: tried on one small picture, as the pipeline calls it."""
    where = processor_dir(cfg, name)
    if where is None:
        return      # the pipeline resizes and normalises itself
    if _native(cfg.model.encoders[name]):
        _check_native_processor(cfg.model.encoders[name], f"model.encoders.{name}", where, add)
        return
    size = cfg.model.encoders[name].image_size
    try:
        from PIL import Image
        from transformers import AutoImageProcessor

        pixels = AutoImageProcessor.from_pretrained(where)(images=Image.new("RGB", (40, 30)),
                                                           return_tensors="pt")["pixel_values"]
    except Exception as exc:  # any reason the processor does not load or run: one config error
        add(f"model.encoders.{name}", f"cannot use the image processor in {where}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}")
        return
    if tuple(pixels.shape[-2:]) != (size, size):
        add(f"model.encoders.{name}.image_size", f"{size}, but the image processor in {where} makes "
            f"{pixels.shape[-2]} x {pixels.shape[-1]} images (preprocessor_config.json)")


def _check_data(cfg: MimoConfig, add) -> None:
    """Real-data fields: files exist, the tokenizer fits the LLM's vocabulary, packing can be masked."""
    d = cfg.data
    _check_choice(d.on_bad_record, BAD_RECORD_MODES, "data.on_bad_record", add)
    if d.index is not None and d.kind != "llava":
        add("data.index", f"only data.kind llava has a record index (energon's records stream in), not {d.kind}")
    if d.kind == "mock":
        return
    if d.packing and cfg.model.language.attention != "bitfield":
        add("data.packing", "needs model.language.attention: bitfield (document ids keep packed samples apart)")
    if d.kind == "llava":
        if not d.path:
            add("data.path", "required for data.kind llava (a JSON list or JSONL file of records)")
        elif os.path.isdir(d.path):
            add("data.path", f"{d.path} is a directory; give the records file (a JSON list or JSONL)")
        elif not os.path.isfile(d.path):
            add("data.path", f"no such file: {d.path}")
        if d.image_root is not None and not os.path.isdir(d.image_root):
            add("data.image_root", f"no such directory: {d.image_root}")
        if d.index is not None:
            where = os.path.dirname(os.path.abspath(d.index))
            if os.path.isdir(d.index):
                add("data.index", f"{d.index} is a directory: name the file that keeps the record index")
            elif not os.path.isdir(where):
                add("data.index", f"no such directory: {where}")
            elif d.path and os.path.realpath(d.index) == os.path.realpath(d.path):
                add("data.index", f"{d.index} is the records file (data.path): name another file for the index "
                    "(a start writes the index there)")
    if d.kind == "energon":
        if not d.path:
            add("data.path", "required for data.kind energon (a directory prepared with `energon prepare`)")
        elif not os.path.exists(d.path):
            add("data.path", f"no such directory: {d.path}")
        elif not os.path.isfile(os.path.join(d.path, ".nv-meta", "dataset.yaml")):
            add("data.path", f"{d.path} is not a prepared energon dataset (no .nv-meta/dataset.yaml): "
                "run `energon prepare` on it")
        else:
            _check_energon_split(d.path, add)
        try:
            import megatron.energon  # noqa: F401
        except ImportError:
            add("data.kind", "energon needs megatron-energon (pip install megatron-energon==7.4.1)")
    vision = [n for n, e in cfg.model.encoders.items() if e.kind == "vision"]
    if len(vision) > 1:
        add("model.encoders", f"data.kind {d.kind} feeds its images to one vision encoder, found {len(vision)}")
    audio = [n for n, e in cfg.model.encoders.items() if e.kind == "audio"]
    if d.kind == "llava" and len(audio) > 1:
        add("model.encoders", f"data.kind llava feeds its audio clips to one audio encoder, found {len(audio)}")
    for n in vision:
        if cfg.model.encoders[n].num_channels != 3:
            add(f"model.encoders.{n}.num_channels", f"must be 3: data.kind {d.kind} decodes images as RGB")
    for n in vision:
        _check_image_processor(cfg, n, add)
    tok = d.tokenizer or tokenizer_dir(cfg)
    path = "data.tokenizer"
    if tok is None:
        hf = [f"{p} ({v})" for p, v in (("model.hf", cfg.model.hf), ("model.language.hf", cfg.model.language.hf)) if v]
        add(path, f"required for data.kind {d.kind} (an HF tokenizer directory)"
            + (f": {' and '.join(hf)} hold{'s' if len(hf) == 1 else ''} no tokenizer files" if hf else
               ", or set model.hf to a directory with one"))
    elif os.path.isfile(tok):
        add(path, f"{tok} is a file; name the HF tokenizer directory that holds it ({os.path.dirname(tok) or '.'}?)")
    elif not os.path.isdir(tok):
        add(path, f"no such directory: {tok}")
    else:
        try:
            from transformers import AutoTokenizer

            n = len(AutoTokenizer.from_pretrained(tok))
        except Exception as exc:  # any reason the directory is not a tokenizer: one config error
            add(path, f"cannot load an HF tokenizer from {tok}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            return
        room = cfg.model.language.vocab_size - len(cfg.model.encoders)
        if n > room:
            add(path, f"vocabulary of {n} tokens does not fit model.language.vocab_size "
                f"({cfg.model.language.vocab_size}) minus {len(cfg.model.encoders)} placeholder id(s)")


EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


def _check_checkpoints(tr, add) -> None:
    """Fields that only mean something with `training.save`."""
    _check_choice(tr.exit_signal, EXIT_SIGNALS, "training.exit_signal", add)
    if tr.exit_duration_minutes is not None and not (_number(tr.exit_duration_minutes) and tr.exit_duration_minutes > 0):
        add("training.exit_duration_minutes", f"must be a positive number of minutes, got {tr.exit_duration_minutes!r}")
    if tr.save is None:
        for key in ("save_interval", "keep_last", "exit_duration_minutes"):
            if getattr(tr, key) is not None:
                add(f"training.{key}", "needs training.save (the directory to write checkpoints to)")
        for key in ("async_save", "exit_signal_handler"):
            if getattr(tr, key):
                add(f"training.{key}", "needs training.save (the directory to write checkpoints to)")
    elif not tr.load_optimizer and isinstance(tr.load, str) and isinstance(tr.save, str) \
            and _inside(tr.load, tr.save):
        # Every restart would load the same weights as a fresh start (step 0, new optimizer and
        # data order) and then save over the checkpoints of the run it started from.
        add("training.load_optimizer", f"false needs training.load ({tr.load}) outside training.save "
            f"({tr.save}): a restart would begin again at step 0 and overwrite the checkpoints")


def _inside(path: str, directory: str) -> bool:
    """`path` is `directory` or lies under it (links resolved)."""
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _check_replan(cfg: MimoConfig, add) -> None:
    """`replan: auto` writes its templates and re-planned layouts next to the checkpoints."""
    tr = cfg.training
    _check_choice(tr.replan, REPLAN_MODES, "training.replan", add)
    if tr.replan == "auto" and tr.save is None:
        add("training.replan", "auto needs training.save (templates.json and layout_<N>.yaml are written there)")
    if tr.replan_min_ranks is not None:
        if tr.replan != "auto":
            add("training.replan_min_ranks", "only takes effect with training.replan: auto")
        elif _layout_sizes_ok(cfg) and tr.replan_min_ranks > cfg.world_size:
            add("training.replan_min_ranks", f"must be <= the ranks the layout uses ({cfg.world_size})")


_INT_MAX = 2**31 - 1   # sizes and counts beyond it overflow the index types of torch and the kernels
_SEED_MAX = 2**32 - 1  # the samplers scale a seed by about 2**20 into torch's 64-bit generator seeds


def _positive_ints(cfg: MimoConfig, add) -> None:
    """Every integer size in the schema is >= 1 (offsets and seeds >= 0), and none is so large that it
    would overflow where it is used (one line naming the field, not an OverflowError from the model)."""
    non_negative = {"rank_offset", "seed", "num_workers", "lr_warmup_iters", "window_size",
                    "moe_shared_expert_intermediate_size"}
    for path, obj in _sections(cfg):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, bool) or not isinstance(v, int):
                continue
            if f.name in non_negative or f.name.startswith("max_") and f.name.endswith("_per_sample"):
                if v < 0:
                    add(f"{path}.{f.name}", f"must be >= 0, got {v}")
            elif v < 1:
                add(f"{path}.{f.name}", f"must be a positive integer, got {v}")
            top = _SEED_MAX if f.name == "seed" else _INT_MAX
            if v > top:
                add(f"{path}.{f.name}", f"must be at most {top}, got {v}")


def _sections(cfg: MimoConfig) -> List[Tuple[str, object]]:
    """The config's dataclass sections with their dotted paths."""
    sections = [("model.language", cfg.model.language), ("data", cfg.data), ("training", cfg.training)]
    sections += [(f"model.encoders.{n}", e) for n, e in cfg.model.encoders.items()]
    return sections + [(f"parallelism.{n}", p) for n, p in cfg.parallelism.items()]


def _nonfinite_floats(cfg: MimoConfig) -> Dict[str, float]:
    """Fields holding NaN or an infinity (YAML's .nan, .inf), which every range check lets through."""
    found = {}
    for path, obj in _sections(cfg):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                found[f"{path}.{f.name}"] = v
            elif isinstance(v, dict):  # rope_scaling
                found.update({f"{path}.{f.name}.{k}": x for k, x in v.items()
                              if isinstance(x, float) and not math.isfinite(x)})
    return found


def _check_placeholders(cfg: MimoConfig, add) -> None:
    """Each encoder's placeholder is a token of the LLM's vocabulary and its own; mock data's text tokens
    need ids below every placeholder."""
    v = cfg.model.language.vocab_size
    if not isinstance(v, int) or v < 1:
        return  # reported by the integer check
    owner: Dict[int, str] = {}  # placeholder id -> its encoder
    for name, tok in cfg.placeholder_ids.items():
        path = f"model.encoders.{name}.placeholder_id"
        if cfg.model.encoders[name].placeholder_id is None:
            if tok < 1:
                add("model.language.vocab_size", f"{v} has no room at its top for {len(cfg.placeholder_ids)} "
                    "placeholder id(s)")
                return
        elif tok >= v:
            add(path, f"{tok} is not a token of the LLM (model.language.vocab_size {v})")
            continue
        if tok in owner:
            add(path, f"{tok} is model.encoders.{owner[tok]}.placeholder_id too; each encoder needs its own")
        owner[tok] = name
    text = cfg.mock_text_ids
    if cfg.data.kind == "mock" and len(text) < 2:
        add("model.language.vocab_size", f"{v} leaves mock data fewer than 2 text token ids (1 .. {text.stop - 1}, "
            "below every placeholder id)")


def _check_schedule(tr, add) -> None:
    """The learning-rate schedule: warmup, then decay from lr to min_lr by the last step."""
    _check_choice(tr.lr_decay_style, LR_DECAY_STYLES, "training.lr_decay_style", add)
    if tr.train_iters > 0 and tr.lr_warmup_iters > tr.train_iters:  # (a bad train_iters is its own error)
        add("training.lr_warmup_iters", f"warmup ({tr.lr_warmup_iters} steps) is longer than the run "
            f"(train_iters = {tr.train_iters})")
    if tr.use_distributed_optimizer and tr.offload_encoders:
        add("training.use_distributed_optimizer", "cannot be combined with training.offload_encoders (offloading "
            "replaces the parameters' storage, which the distributed optimizer gathers updated weights into)")
    if not tr.grad_reduce_in_fp32 and tr.precision != "bf16":
        add("training.grad_reduce_in_fp32", f"false needs precision: bf16 (precision {tr.precision} keeps "
            "fp32 gradients)")
    if tr.lr > 0 and not 0 <= tr.min_lr <= tr.lr:  # (a bad lr is its own error)
        add("training.min_lr", f"must be between 0 and training.lr ({tr.lr}), got {tr.min_lr}")
    if tr.lr_decay_style == "constant" and tr.min_lr not in (0, tr.lr):
        add("training.min_lr", "has no effect with lr_decay_style: constant (use linear or cosine)")


def _check_energon_split(path: str, add) -> None:
    """Training reads the dataset's `train` split: it must have one (`.nv-meta/split.yaml`)."""
    import yaml

    split = os.path.join(path, ".nv-meta", "split.yaml")
    try:
        with open(split) as f:
            parts = (yaml.safe_load(f) or {}).get("split_parts") or {}
    except (OSError, yaml.YAMLError, AttributeError) as exc:
        add("data.path", f"cannot read {split}: {str(exc).splitlines()[0]} (re-run `energon prepare`)")
        return
    if not parts.get("train"):
        add("data.path", f"{path} has no 'train' split to train on ({split} has: "
            f"{', '.join(parts) or 'none'}): re-run `energon prepare` with a train share")


def _check_choice(value, choices, path, add) -> None:
    if value not in choices:
        # The loader reads a YAML boolean in a text field as the word (`off`: YAML 1.1's false).
        hint = " (YAML reads true/yes/on as 'on' and false/no/off as 'off')" if value in ("on", "off") else ""
        add(path, f"must be one of {', '.join(choices)}, got {value!r}{hint}")


def _check_heads(m, path: str, add) -> None:
    if getattr(m, "kv_channels", None) is None and m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads:
        add(f"{path}.hidden_size", f"must be divisible by num_attention_heads ({m.num_attention_heads})")


def _check_attention_kernel(m, path: str, add) -> None:
    """`attention_kernel`: KernelConfig's fields that KernelConfig accepts for the module's head dim;
    only with attention: bitfield."""
    fields = m.attention_kernel
    if fields is None:
        return
    path = f"{path}.attention_kernel"
    if m.attention != "bitfield":
        add(path, "only takes effect with attention: bitfield")
        return
    problems = field_problems(fields)
    for key, reason in problems:
        add(f"{path}.{key}" if key else path, reason)
    heads = m.num_attention_heads
    head_dim = getattr(m, "kv_channels", None) or (m.hidden_size // heads if heads > 0 else 0)
    if head_dim > 0:
        bad = {key for key, _ in problems}
        problem = resolve_problem({k: v for k, v in fields.items() if k not in bad}, head_dim)
        if problem:
            add(f"{path}.{problem[0]}", problem[1])


def _native(enc: EncoderConfig) -> bool:
    return enc.kind == "vision" and enc.resolution == "native"


def _tokens_ok(enc: EncoderConfig) -> bool:
    """Whether `enc.tokens_per_item` is defined (fixed-size items, sizes that divide)."""
    if _native(enc):
        return False    # each image has its own token count
    if enc.kind == "vision":
        return bool(enc.image_size and enc.patch_size and enc.image_size % enc.patch_size == 0)
    return enc.frames_per_token > 0 and enc.clip_frames % enc.frames_per_token == 0


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive(v, path: str, add) -> None:
    """A number > 0 (a value of another type is the type check's to report)."""
    if _number(v) and not v > 0:
        add(path, f"must be > 0, got {v}")


def _check_encoder(enc: EncoderConfig, path: str, add) -> None:
    _positive(enc.norm_eps, f"{path}.norm_eps", add)
    _check_choice(enc.kind, ENCODER_KINDS, f"{path}.kind", add)
    _check_choice(enc.projector.kind, PROJECTOR_KINDS, f"{path}.projector.kind", add)
    _check_choice(enc.attention, ATTENTION_KINDS, f"{path}.attention", add)
    _check_attention_kernel(enc, path, add)
    _check_choice(enc.activation, ACTIVATIONS, f"{path}.activation", add)
    _check_choice(enc.projector.activation, ACTIVATIONS[:-1], f"{path}.projector.activation", add)
    _check_choice(enc.frontend, AUDIO_FRONTENDS, f"{path}.frontend", add)
    if enc.class_token and enc.kind != "vision":
        add(f"{path}.class_token", "only vision encoders have a class token")
    if enc.frontend == "conv" and (enc.kind != "audio" or enc.frames_per_token != 2):
        add(f"{path}.frontend", "conv (Whisper) is an audio front-end with frames_per_token: 2")
    _check_heads(enc, path, add)
    _check_choice(enc.resolution, RESOLUTIONS, f"{path}.resolution", add)
    _check_choice(enc.position_embedding, VISION_POSITION_EMBEDDINGS, f"{path}.position_embedding", add)
    _check_choice(enc.normalization, NORMALIZATIONS, f"{path}.normalization", add)
    if enc.resolution == "native" and enc.kind != "vision":
        add(f"{path}.resolution", "native is for vision encoders")
    if enc.resolution not in RESOLUTIONS:
        return      # which of the size rules below apply is unknown
    if _native(enc):
        _check_native(enc, path, add)
        return
    for f, bad, why in (("position_embedding", enc.position_embedding == "rope2d", "rope2d"),
                        ("projector.kind", enc.projector.kind == "patch_merger", "patch_merger"),
                        ("window_size", enc.window_size > 0, f"{enc.window_size} (window attention)"),
                        ("full_attention_layers", enc.full_attention_layers is not None, "a list")):
        if bad:
            add(f"{path}.{f}", f"{why} needs resolution: native")
    if enc.kind == "vision":
        for f in ("image_size", "patch_size"):
            if getattr(enc, f) is None:
                add(f"{path}.{f}", "required for a vision encoder")
        if enc.image_size and enc.patch_size and enc.image_size > 0 and enc.patch_size > 0:
            if enc.image_size % enc.patch_size:
                add(f"{path}.image_size", f"must be divisible by patch_size ({enc.patch_size})")
    elif enc.kind == "audio":
        if enc.frames_per_token > 0 and enc.clip_frames % enc.frames_per_token:
            add(f"{path}.clip_frames", f"must be divisible by frames_per_token ({enc.frames_per_token})")


def _native_sizes_ok(enc: EncoderConfig) -> bool:
    return all(isinstance(v, int) and v > 0 for v in (enc.patch_size, enc.spatial_merge_size, enc.temporal_patch_size,
                                                      enc.min_pixels, enc.max_pixels))


def _check_native(enc: EncoderConfig, path: str, add) -> None:
    """A native-resolution ViT (Qwen2-VL / Qwen2.5-VL): each image keeps its size, cut into
    patch_size patches, 2-D rotary positions, spatial_merge_size^2 patches merged per LLM token."""
    if enc.patch_size is None:
        add(f"{path}.patch_size", "required for a vision encoder")
    if enc.image_size is not None:
        add(f"{path}.image_size", "has no effect with resolution native (each image keeps its own size, "
                                  "within min_pixels and max_pixels)")
    if enc.class_token:
        add(f"{path}.class_token", "resolution native has no class token")
    if enc.position_embedding != "rope2d" and enc.position_embedding in VISION_POSITION_EMBEDDINGS:
        add(f"{path}.position_embedding", "resolution native needs rope2d (a learned table fits one image size)")
    if enc.projector.kind != "patch_merger" and enc.projector.kind in PROJECTOR_KINDS:
        add(f"{path}.projector.kind", "resolution native needs patch_merger (it merges spatial_merge_size^2 "
                                      "patches into one LLM token)")
    heads, hidden = enc.num_attention_heads, enc.hidden_size
    if isinstance(heads, int) and isinstance(hidden, int) and heads > 0 and hidden % heads == 0 and hidden // heads % 4:
        add(f"{path}.num_attention_heads", f"rope2d needs a head dim divisible by 4 (rows and columns each take "
                                           f"half the rotary pairs), got {hidden} / {heads} = {hidden // heads}")
    if not _native_sizes_ok(enc):
        return      # reported by _positive_ints / above
    if enc.min_pixels > enc.max_pixels:
        add(f"{path}.min_pixels", f"must be <= max_pixels ({enc.max_pixels}), got {enc.min_pixels}")
    factor = enc.patch_size * enc.spatial_merge_size
    if enc.window_size % factor:
        add(f"{path}.window_size", f"must be a multiple of patch_size * spatial_merge_size ({factor}): windows are "
                                   f"whole merge blocks, got {enc.window_size}")
    layers = enc.full_attention_layers
    if layers is not None:
        if not isinstance(layers, list):
            add(f"{path}.full_attention_layers", f"must be a list of layer indices, got {layers!r}")
            return
        if layers and enc.window_size == 0:
            add(f"{path}.full_attention_layers", "only takes effect with window_size > 0 (without windows every "
                                                 "layer sees the whole image)")
        for i, n in enumerate(layers):
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < enc.num_layers:
                add(f"{path}.full_attention_layers[{i}]", f"must be a layer index in [0, {enc.num_layers}), got {n!r}")
        if len(set(map(repr, layers))) != len(layers):
            add(f"{path}.full_attention_layers", f"lists a layer twice: {layers}")


def _check_native_fits(enc: EncoderConfig, path: str, seq_length: int, add) -> None:
    """One image at max_pixels must fit in a sequence with a text token to spare, as a
    fixed-size item must: smart_resize keeps an image's pixels <= max_pixels, so its tokens stay
    <= max_pixels / (patch_size * spatial_merge_size)^2, give or take a few blocks for images near
    the 200:1 aspect limit (so the data must still count each image's tokens from its own grid)."""
    tokens, factor = max_placeholder_count(enc), enc.patch_size * enc.spatial_merge_size
    if tokens >= seq_length:
        add(f"{path}.max_pixels", f"an image of {enc.max_pixels} pixels is {tokens} tokens (max_pixels / "
                                  f"{factor}^2), which does not fit in data.seq_length ({seq_length}); use "
                                  f"max_pixels <= {(seq_length - 1) * factor * factor}")


def _check_native_processor(enc: EncoderConfig, path: str, where: str, add) -> None:
    """A native encoder's images are cut by mimo.data.native_images with the encoder's own sizes;
    the HF image processor's settings (`qwen_processor_settings`) contribute image_mean / image_std
    and must cut the same patches."""
    from .hf_files import qwen_processor_settings

    try:
        pc = qwen_processor_settings(where)
    except (OSError, ValueError, RecursionError) as exc:
        add(path, f"cannot read the image processor settings in {where}: {exc}")
        return
    for key, ours in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                      ("merge_size", "spatial_merge_size")):
        if pc[key] is not None and pc[key] != getattr(enc, ours):
            add(f"{path}.{ours}", f"{getattr(enc, ours)}, but the image processor in {where} uses {key} {pc[key]} "
                                  f"({pc['file']})")
    for key in ("image_mean", "image_std"):
        v = pc[key]
        if v is not None and (not isinstance(v, list) or len(v) != enc.num_channels):
            add(path, f"the image processor in {where} has {key} {v!r}: expected {enc.num_channels} numbers")


def _module(cfg: MimoConfig, name: str):
    return cfg.model.language if name == LANGUAGE else cfg.model.encoders[name]


def _check_parallelism(cfg: MimoConfig, world_size: Optional[int], add) -> None:
    modules = cfg.modules
    for name in cfg.parallelism:
        if name not in modules:
            add(f"parallelism.{name}", f"no such module (modules: {', '.join(modules)})")
    missing = [m for m in modules if m not in cfg.parallelism]
    for m in missing:
        add(f"parallelism.{m}", "missing: every module needs a parallelism entry")
    if missing or any(p.size < 1 for p in cfg.parallelism.values()):
        return

    for name in modules:
        par, mod, path = cfg.parallelism[name], _module(cfg, name), f"parallelism.{name}"
        _check_module_layout(name, par, mod, path, add)
        _check_sequence_parallel(cfg, name, par, mod, f"{path}.sp", add)

    # Rank ranges: identical (colocated) or disjoint (non-colocated), inside the world.
    for i, a in enumerate(modules):
        for b in modules[i + 1:]:
            if placement(cfg.parallelism[a], cfg.parallelism[b]) == "overlap":
                pa, pb = cfg.parallelism[a], cfg.parallelism[b]
                add(f"parallelism.{b}", f"ranks [{pb.ranks.start}, {pb.ranks.stop}) partially overlap "
                    f"parallelism.{a} ranks [{pa.ranks.start}, {pa.ranks.stop}); they must be identical or disjoint")
    # One line for a world size the layout does not fit: the first module past it.
    beyond = [n for n in modules if world_size is not None and cfg.parallelism[n].ranks.stop > world_size]
    if beyond:
        p = cfg.parallelism[beyond[0]]
        add(f"parallelism.{beyond[0]}", f"needs ranks [{p.ranks.start}, {p.ranks.stop}) but the world size is "
            f"{world_size}")
    # Without a world size, the ranks the layout spans: a gap in them is ranks that would run nothing.
    world = world_size if world_size is not None else max(p.ranks.stop for p in cfg.parallelism.values())
    idle = _gaps([cfg.parallelism[n].ranks for n in modules], world)
    if idle and not beyond:
        add("parallelism", f"ranks {', '.join(idle)} of world size {world} belong to no module")
    if cfg.training.offload_encoders:
        problem = offload_problem(cfg.parallelism, list(cfg.model.encoders))
        if problem:
            add("training.offload_encoders", problem)

    _check_batch(cfg, add)


def _gaps(ranges: List[range], world: int) -> List[str]:
    """The ranks of [0, world) in none of `ranges`, as "a" or "a-b" spans (from the ranges' ends: a
    layout's sizes may be large)."""
    out, covered = [], 0
    for r in sorted((r for r in ranges if len(r)), key=lambda r: r.start):
        if r.start > covered:
            out.append(str(covered) if r.start - covered == 1 else f"{covered}-{r.start - 1}")
        covered = max(covered, r.stop)
    if world > covered:
        out.append(str(covered) if world - covered == 1 else f"{covered}-{world - 1}")
    return out


def _layout_sizes_ok(cfg: MimoConfig) -> bool:
    """Whether every module's sizes are positive integers (else the layout is reported, not sized)."""
    return all(isinstance(p.size, int) and p.size > 0 for p in cfg.parallelism.values()) and bool(cfg.parallelism)


def _check_module_layout(name, par: ParallelConfig, mod, path: str, add) -> None:
    if par.tp > 0:
        dims = [("num_attention_heads", mod.num_attention_heads), ("hidden_size", mod.hidden_size),
                ("ffn_hidden_size", mod.ffn_hidden_size)]
        if isinstance(mod, LanguageConfig):
            dims.insert(1, ("num_query_groups", mod.num_query_groups))
            # The vocab-parallel embedding and output layer split the vocabulary over TP;
            # mimo does not pad it (Megatron-LM's --make-vocab-size-divisible-by).
            dims.append(("vocab_size", mod.vocab_size))
        for field, value in dims:
            if isinstance(value, int) and value % par.tp:
                add(f"{path}.tp", f"must divide {field} ({value})")
    if par.pp > mod.num_layers:
        add(f"{path}.pp", f"must be <= num_layers ({mod.num_layers})")
    if name != LANGUAGE and par.cp != 1:
        add(f"{path}.cp", "encoders run with cp = 1 (context parallelism is for the LLM)")
    if name == LANGUAGE and par.cp > 1 and mod.attention != "bitfield":
        add(f"{path}.cp", "context parallelism needs model.language.attention: bitfield")
    _check_expert_layout(name, par, mod, path, add)
    _check_choice(par.recompute, RECOMPUTE_KINDS, f"{path}.recompute", add)
    if par.stage_layers is not None:
        sl = par.stage_layers
        if len(sl) != par.pp:
            add(f"{path}.stage_layers", f"needs one entry per pipeline stage (pp = {par.pp}), got {len(sl)}")
        if any(not isinstance(x, int) or x < 1 for x in sl):
            add(f"{path}.stage_layers", "every stage needs at least one layer")
        elif sum(sl) != mod.num_layers:
            add(f"{path}.stage_layers", f"must sum to num_layers ({mod.num_layers}), got {sum(sl)}")


def _check_expert_layout(name, par: ParallelConfig, mod, path: str, add) -> None:
    """Expert parallelism (docs/moe.md): `ep` and `etp` split an MoE LLM's experts over a second
    decomposition of its own tp*cp*dp ranks per pipeline stage; they add no ranks."""
    if name != LANGUAGE or not mod.is_moe:
        why = ("encoders have no experts (expert parallelism is for an MoE LLM)" if name != LANGUAGE else
               "model.language has no experts (set model.language.num_moe_experts)")
        for f in ("ep", "etp"):
            if getattr(par, f) != 1:
                add(f"{path}.{f}", f"must be 1: {why}")
        return
    if par.ep < 1 or par.etp < 1:
        return  # reported by _positive_ints
    if isinstance(mod.num_moe_experts, int) and mod.num_moe_experts > 0 and mod.num_moe_experts % par.ep:
        add(f"{path}.ep", f"must divide model.language.num_moe_experts ({mod.num_moe_experts})")
    dense = par.tp * par.cp * par.dp
    if dense % (par.etp * par.ep):
        add(f"{path}.ep", f"etp * ep ({par.etp} * {par.ep}) must divide tp * cp * dp ({par.tp} * {par.cp} * {par.dp}): "
                          "expert parallelism adds no ranks, it re-divides the LLM's own")
    ffn = mod.moe_ffn_hidden_size or mod.ffn_hidden_size
    if isinstance(ffn, int) and ffn % par.etp:
        add(f"{path}.etp", f"must divide the experts' FFN width ({ffn})")
    if par.etp > 1 and mod.add_bias_linear:
        add(f"{path}.etp", "must be 1 with model.language.add_bias_linear: true (megatron-core's MoE biases "
                           "need expert tensor parallelism 1)")
    if mod.moe_grouped_gemm is True and isinstance(ffn, int) and isinstance(mod.hidden_size, int):
        problem = grouped_gemm_problem(mod.hidden_size, ffn, par.etp, mod.add_bias_linear)
        if problem:
            add("model.language.moe_grouped_gemm", f"true {problem}")
    if par.tp > 1 and par.sp is not True:
        add(f"{path}.sp", f"must be true for an MoE LLM with tp > 1 (megatron-core's MoE layer routes the "
                          f"sequence-parallel shard of each TP rank), got tp {par.tp}")
    shared = mod.moe_shared_expert_intermediate_size
    if isinstance(shared, int) and shared > 0 and shared % par.tp:
        add(f"{path}.tp", f"must divide model.language.moe_shared_expert_intermediate_size ({shared})")


def _check_moe(lang: LanguageConfig, add) -> None:
    """The MoE fields of model.language (docs/moe.md)."""
    path = "model.language"
    fields = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
              "moe_shared_expert_gate", "moe_layer_freq", "moe_router_pre_softmax", "moe_aux_loss_coeff",
              "moe_token_dispatcher_type", "moe_grouped_gemm")
    if not lang.is_moe:
        defaults = LanguageConfig(num_layers=1, hidden_size=1, num_attention_heads=1, vocab_size=1,
                                  max_sequence_length=1)
        for f in fields:
            if getattr(lang, f) != getattr(defaults, f):
                add(f"{path}.{f}", "only takes effect with model.language.num_moe_experts")
        return
    _check_choice(lang.moe_token_dispatcher_type, MOE_DISPATCHERS, f"{path}.moe_token_dispatcher_type", add)
    n, k = lang.num_moe_experts, lang.moe_router_topk
    if isinstance(n, int) and isinstance(k, int) and n > 0 and k > n:
        add(f"{path}.moe_router_topk", f"must be <= num_moe_experts ({n}), got {k}")
    if k == 1 and not lang.moe_router_pre_softmax:
        # A softmax over the one chosen expert weighs every token 1.0; megatron-core's router refuses it.
        add(f"{path}.moe_router_topk", "1 needs moe_router_pre_softmax: true (the chosen expert weighted by its "
                                       "probability over all experts)")
    freq = lang.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != lang.num_layers or any(isinstance(x, bool) or x not in (0, 1) for x in freq):
            add(f"{path}.moe_layer_freq", f"a list needs one 0 (dense) or 1 (MoE) per layer ({lang.num_layers}), "
                                          f"got {freq!r}")
        elif not any(freq):
            add(f"{path}.moe_layer_freq", "marks no layer MoE")
    elif isinstance(freq, bool) or not isinstance(freq, int):
        add(f"{path}.moe_layer_freq", f"must be a positive integer or a list of 0/1 per layer, got {freq!r}")
    if not lang.moe_aux_loss_coeff >= 0:
        add(f"{path}.moe_aux_loss_coeff", f"must be >= 0, got {lang.moe_aux_loss_coeff}")
    shared = lang.moe_shared_expert_intermediate_size
    if isinstance(shared, int) and shared > 0 and lang.add_bias_linear:
        add(f"{path}.moe_shared_expert_intermediate_size", "a shared expert needs add_bias_linear: false "
                                                           "(megatron-core's shared experts have no biases)")
    if lang.moe_shared_expert_gate and not (isinstance(shared, int) and shared > 0):
        add(f"{path}.moe_shared_expert_gate", "needs a shared expert (moe_shared_expert_intermediate_size > 0)")
    if lang.moe_grouped_gemm not in ("auto", True, False):
        add(f"{path}.moe_grouped_gemm", f"must be auto, true or false, got {lang.moe_grouped_gemm!r}")


def grouped_gemm_problem(hidden_size: int, expert_ffn: int, etp: int, add_bias_linear: bool) -> Optional[str]:
    """Why routed experts cannot run as grouped GEMMs (mimo.model.grouped_experts), or None: they
    have no biases, and every GEMM dimension (hidden, each expert-TP rank's FFN width, twice that for
    a gated MLP) is a multiple of 8 elements (torch's grouped GEMM wants 16-byte-aligned rows)."""
    if add_bias_linear:
        return "needs add_bias_linear: false (grouped experts have no biases)"
    if hidden_size % 8 or (expert_ffn // max(etp, 1)) % 8:
        return (f"needs hidden_size ({hidden_size}) and the experts' FFN width per expert-TP rank "
                f"({expert_ffn} / etp {etp}) to be multiples of 8")
    return None


def _check_sequence_parallel(cfg: MimoConfig, name: str, par: ParallelConfig, mod, path: str, add) -> None:
    """Sequence parallelism splits each sequence (an LLM sample's CP share, an encoder item's tokens)
    into tp equal shards."""
    if par.sp is not True or not isinstance(par.tp, int) or par.tp <= 1:
        return
    if name == LANGUAGE:
        n, what = cfg.data.seq_length, "data.seq_length"
        if isinstance(n, int) and isinstance(par.cp, int) and par.cp >= 1 and n % (par.tp * par.cp):
            add(path, f"needs {what} ({n}) divisible by tp * cp ({par.tp} * {par.cp})")
    elif _native(mod):
        # A native ViT splits its packed patches: every image holds a whole number of merge blocks of
        # spatial_merge_size^2 patches (times its frames), and only that is sure to split into tp shards.
        block = mod.spatial_merge_size ** 2 if isinstance(mod.spatial_merge_size, int) else 0
        if block > 0 and block % par.tp:
            add(path, f"needs tp ({par.tp}) dividing spatial_merge_size^2 ({block}): an image holds a multiple of "
                      f"{block} patches, which {par.tp} shards may not split (use tp <= {block} dividing it, or sp: false)")
    elif _tokens_ok(mod):
        # A vision class token (CLIP) is part of the sequence the encoder's layers see.
        tokens = mod.tokens_per_item + (1 if mod.class_token else 0)
        if tokens % par.tp:
            add(path, f"needs the encoder's tokens per item ({tokens}, class token included) divisible by tp ({par.tp})")


def _check_batch(cfg: MimoConfig, add) -> None:
    tr, pl = cfg.training, cfg.parallelism[LANGUAGE]
    g, m, dl = tr.global_batch_size, tr.micro_batch_size, pl.dp
    if min(g, m) < 1:
        return  # already reported as non-positive; the arithmetic below would divide by zero
    if g % (m * dl):
        add("training.global_batch_size", f"must be divisible by micro_batch_size * language dp ({m} * {dl} = {m * dl})")
    # Encoder DP divides a step's (colocated) or a microbatch's (non-colocated) items, not its
    # samples, so no rule ties an encoder's dp to the batch sizes or to the LLM's dp.
