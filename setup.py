"""megatron-agentrl: agentic RL (multi-turn, multi-task GRPO) on megatron-core with SGLang rollouts."""
from setuptools import find_packages, setup

setup(
    name="megatron-agentrl",
    version="0.1.0",
    description="Asynchronous multi-turn, multi-task agentic RL on megatron-core (after AgentRL, arXiv 2510.04206)",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["megatron_agentrl*", "rollout_sglang*", "env_controller*"]),
    # SGLang's request contract, read from its wheel (rollout_sglang.testing.sglang_contract)
    package_data={"rollout_sglang.testing": ["sglang_contract_*.json"],
                  "rollout_sglang.engines": ["sglang_server_flags_*.json"]},
    install_requires=[
        # ranges that admit the pinned SGLang's own versions (the `sglang` extra installs us next to
        # it; tests/rollout/test_sglang_pins.py checks every shared requirement against its wheel's
        # Requires-Dist); constraints.txt holds the exact versions CI tests. On a CPU-only machine
        # install the CPU wheel of torch first (see Makefile)
        "torch>=2.13.0,<2.15",
        "megatron-core==0.16.1",
        "transformers>=5.19.0,<5.24",
        "tokenizers>=0.23.2,<0.24",
        "safetensors==0.8.0",
        "numpy>=2.3,<2.5",  # SGLang needs mistral_common, which takes numpy < 2.4 on Python 3.11
        "pyyaml==6.0.3",
        "jinja2==3.1.6",
        "tensorboard==2.21.0",
        "wandb>=0.31,<0.32",  # logging.wandb: imported only when a run asks for it
        # rollout.agent=gateway: the client handed to the user's agent function (sglang pins openai 2.8.0), on
        # aiohttp's transport (openai's `aiohttp` extra, httpx-aiohttp)
        "openai>=2.8,<4",
        "httpx-aiohttp==0.2.0",
        "matplotlib==3.11.2",
        "rich==15.0.0",
        # rollout_sglang.engines.sglang_client: the SGLang server's HTTP client (sync, pooled)
        "httpx==0.28.1",
        "tqdm==4.70.1",  # weight converters' progress bars
        # env_controller: asyncio HTTP (controller, worker server, client) and Prometheus metrics
        "aiohttp==3.14.5",
        "prometheus_client==0.26.0",
        # env_controller.http.json_io: JSON parsing on the controller's hot path (SGLang needs it too)
        "msgspec==0.22.0",
        "uvloop==0.23.0; sys_platform != 'win32'",
        # env_controller sandboxes and the db task: the Docker SDK and a MySQL/MariaDB client
        "docker==7.2.0",
        "PyMySQL==1.2.4",
        # megatron_agentrl.launch: Ray placement (train pool, rollout pools, env controller); it does not pull torch
        "ray==2.60.0",
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]==2.20.2", "nvidia-ml-py==13.615.71"],
        "sglang": ["sglang==0.5.23"],
        # agentrl-worker: the AgentRL task-worker package, for the controller compatibility test
        # pytest-xdist: `make test` on two workers (tests/README.md)
        "dev": ["pytest==9.2.0", "pytest-xdist==3.8.0", "agentrl-worker==0.4.0", "import-linter==2.16", "ruff==0.17.6",
                # hypothesis: property tests of the tool-call parsers; schemathesis: the HTTP APIs fuzzed from their
                # OpenAPI description
                "hypothesis==6.170.17", "schemathesis==4.32.5",
                # the gateway's tests run real agent frameworks against it (openai is sglang's 2.8.0: openai-agents
                # 0.6.2 is the newest that accepts it)
                "anthropic==2.12.0", "openai-agents==0.6.2", "smolagents==1.26.0",
                # peft: our LoRA is checked against its adapters on the Hugging Face model
                "peft==0.21.2"],
    },
    entry_points={"console_scripts": ["agentrl=megatron_agentrl.cli:main"]},
)
