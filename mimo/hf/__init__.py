"""Hugging Face weights: import at any layout, export back (see README, "Starting from Hugging Face weights")."""

from mimo.config.hf_files import processor_dir, tokenizer_dir

from .load import check_hf_weights, load_hf_part
from .mapping import HFModule, hf_modules
from .source import HFWeightsError, Source

__all__ = ["HFModule", "HFWeightsError", "Source", "check_hf_weights", "hf_modules", "load_hf_part",
           "processor_dir", "tokenizer_dir"]
