"""mimo: heterogeneous-parallel multimodal LLM training as a megatron-core plugin."""

from setuptools import find_packages, setup

setup(
    name="mimo",
    version="0.1.0",
    description="Heterogeneous-parallel multimodal LLM training on megatron-core",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["mimo", "mimo.*"]),
    install_requires=[
        # 2.13.0 matches both the CPU build (2.13.0+cpu) and the CUDA build;
        # scripts/setup.sh picks the CPU build where there is no GPU.
        "torch==2.13.0",
        "megatron-core==0.16.1",
        # The Triton release torch 2.13.0's CUDA build pins.
        "triton==3.7.1",
        "pyyaml==6.0.3",
        "numpy>=1.26,<3",
        # megatron-core's HyperCommGrid needs einops but does not declare it.
        "einops==0.8.1",
        # Progress bar of examples/pretrain_mimo.py on an interactive terminal.
        "tqdm==4.70.1",
        # Hugging Face weights (mimo.hf): memory-mapped, sliced reads of *.safetensors.
        "safetensors==0.8.0",
        # Real data (data.kind: llava): HF tokenizers and image processors, Pillow to decode images.
        "transformers==5.23.0",
        "tokenizers==0.23.3",
        "pillow==13.0.0",
        # data.kind: energon (its loader and savable state); pulls no other torch / megatron-core.
        "megatron-energon==7.4.1",
    ],
    extras_require={
        # The metrics tests write TensorBoard events and draw timelines; transformers builds the
        # tiny reference models of the HF tests and reloads exports; pytest-xdist runs two test
        # files at a time (scripts/test.sh): a multi-rank test leaves cores idle while ranks start
        # and wait on each other.
        "test": ["pytest==9.0.3", "pytest-xdist==3.8.0", "tensorboard==2.21.0", "matplotlib==3.11.2",
                 "transformers==5.23.0"],
        # training.tensorboard_dir, training.wandb_project, tools/timeline.py
        "metrics": ["tensorboard==2.21.0", "wandb==0.23.1", "matplotlib==3.11.2"],
        "hf": ["transformers==5.23.0"],
        "gpu": ["transformer-engine[pytorch]==2.20.2"],
    },
)
