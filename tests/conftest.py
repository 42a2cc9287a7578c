import os
import sys

# Spawned ranks import test modules by name; make the tests folder importable.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-rank sweeps left out of the default run (-m slow to run them)")


# The longest test files, longest first (seconds on 2 cores, 2026-11-27). scripts/test.sh runs
# files on two workers, each file whole on one, handed out in collection order: starting the
# long ones first lets both workers finish together instead of one running the last long file
# alone. Files not listed keep pytest's order after these; a stale entry only costs balance.
_LONGEST_FIRST = [
    "test_entrain_parity.py",       # ~180 s
    "test_native_balance.py",       # ~75 s
    "test_replan.py",               # ~75 s
    "test_checkpoint_restart.py",   # ~75 s
    "test_native_training.py",      # ~60 s
    "test_gpu_check_layouts.py",    # ~50 s
    "test_checkpoint.py",           # ~50 s
    "test_parity_tool.py",          # ~40 s
    "test_checkpoint_cli.py",       # ~40 s
    "test_pipeline_parity.py",      # ~35 s
    "test_checkpoint_safe_load.py", # ~35 s
    "test_moe.py",                  # ~35 s
    "test_llava_data.py",           # ~35 s
    "test_cp_behind_boundary.py",   # ~30 s
    "test_data_per_rank.py",        # ~30 s
    "test_pretrain_cli.py",         # ~30 s
    "test_checkpoint_writer_helper.py",  # ~25 s
    "test_native_items.py",         # ~20 s
    "test_memory_knobs.py",         # ~20 s
    "test_moe_distopt.py",          # ~20 s
    "test_moe_checkpoint.py",       # ~20 s
    "test_optimizer.py",            # ~20 s
    "test_planner_profile.py",      # ~20 s
    "test_moe_hf.py",               # ~20 s
    "test_attn_megatron.py",        # ~17 s
    "test_training_parity.py",      # ~15 s
    "test_cp_model.py",             # ~15 s
]


def pytest_collection_modifyitems(session, config, items):
    order = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    # A stable sort on the file alone: each file's tests stay together and in their order.
    items.sort(key=lambda item: order.get(item.path.name, len(order)))
