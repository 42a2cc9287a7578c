import os
import sys

# Spawned ranks import test modules by name; make the tests folder importable.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-rank sweeps left out of the default run (-m slow to run them)")
