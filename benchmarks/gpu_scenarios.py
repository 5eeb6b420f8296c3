"""Links as a GPU would see them: the arithmetic behind benchmarks/wan.py's GPU-equivalent scenarios (pure
functions, no I/O; docs/BENCHMARKS.md has the derivation in words).

A scenario names a model shape, a GPU's effective FLOP rate and a home link. On the GPU, a middle stage computes a
microbatch in `gpu_compute_seconds` and its uplink sends that microbatch's activations forward and their gradient
back; the link's transfer time over the compute time (and its delay over the compute time) decide how busy the GPU
is. On this machine a local swarm computes a microbatch in a time measured on unshaped links; `local_link` gives
each emulated link the bandwidth and delay that make the two ratios the same here as on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

RTX_4090 = 165e12  # dense bf16 FLOP/s (tensor cores, fp32 accumulation)
H100 = 989e12


@dataclass(frozen=True)
class Scenario:
    name: str
    width: int
    depth: int
    stages: int
    intermediate: int
    kv_width: int  # key/value heads x head size
    context: int
    microbatch: int  # sequences
    gpu_flops: float
    utilisation: float  # the fraction of gpu_flops a stage reaches (MFU)
    link_bits: float  # per direction
    delay: float  # seconds, one way, per boundary (a boundary crosses two peers' links)
    checkpointing: bool = True
    # a flush per optimizer step (the step gate) costs a round trip per step: GPU swarms take large steps
    # (the llama-1b preset's 64 microbatches of 8,192 tokens; swarm/pipeline_schedule.py)
    microbatches_per_step: int = 64

    @property
    def tokens(self) -> int:
        return self.microbatch * self.context

    def layer_parameters(self, method: str = "8bit") -> int:
        """A block's parameters; in a subspace model its two writing layers are [width/16, inner] (o_proj, down_proj)."""
        write = self.width // 16 if method.startswith("subspace") else self.width
        attention = self.width * self.width + 2 * self.width * self.kv_width + write * self.width
        return attention + 2 * self.width * self.intermediate + write * self.intermediate + 2 * self.width

    def gpu_compute_seconds(self, method: str = "8bit") -> float:
        """A middle stage's forward and backward of one microbatch: 6 FLOPs per parameter and token (8 with
        activation checkpointing, which runs forward twice), plus causal attention's 6 x context x width per token
        and layer (8 with checkpointing). A subspace model's blocks have fewer parameters, so it computes less."""
        layers = self.depth / self.stages
        per_token = layers * (self.layer_parameters(method) + self.context * self.width)
        multiplier = 8 if self.checkpointing else 6
        return multiplier * per_token * self.tokens / (self.gpu_flops * self.utilisation)

    def gpu_uplink_bytes(self, method: str) -> float:
        """What a middle stage's uplink sends per microbatch: the forward boundary (values and the token tensor)
        and the backward one (values). 8bit: width bytes per token and int64 targets; subspace: width/16 bytes per
        token (model.subspace_rank) and the int16 window; subspace-4bit: those coordinates at half a byte each and a
        2-byte scale per token (swarm/wire/four_bit.py)."""
        if method == "8bit":
            values, token_bytes = self.width, 8
        elif method == "subspace":
            values, token_bytes = self.width // 16, 2
        elif method == "subspace-4bit":
            values, token_bytes = self.width // 32 + 2, 2
        else:
            raise ValueError(f"unknown method {method!r}: 8bit, subspace or subspace-4bit")
        return self.tokens * (2 * values + token_bytes)

    def transfer_ratio(self, method: str) -> float:
        """Seconds the uplink needs for one microbatch over seconds the GPU computes it."""
        return self.gpu_uplink_bytes(method) * 8 / self.link_bits / self.gpu_compute_seconds(method)

    def delay_ratio(self, method: str = "8bit") -> float:
        return self.delay / self.gpu_compute_seconds(method)

    def compute_bound_tokens_per_second(self, method: str = "8bit") -> float:
        """Tokens per second through the pipeline (and through each of its GPUs) when no GPU ever waits."""
        return self.tokens / self.gpu_compute_seconds(method)


def local_link(scenario: Scenario, method: str, local_seconds: float, local_uplink_bytes: float) -> str:
    """The emulated link (LinkSpec text, the same for every peer) under which a local swarm that computes a
    microbatch in `local_seconds` and whose middle stage's uplink sends `local_uplink_bytes` per microbatch has
    the scenario's transfer and delay ratios. The delay is split over the two links of a boundary."""
    bits = local_uplink_bytes * 8 / (scenario.transfer_ratio(method) * local_seconds)
    delay = scenario.delay_ratio(method) * local_seconds / 2
    return f"{bits / 1e3:.3f}kbit/{delay * 1e3:.3f}ms"


LLAMA_1B = {"width": 2048, "depth": 22, "stages": 4, "intermediate": 5632, "kv_width": 256, "context": 2048}
SCENARIOS = {
    scenario.name: scenario
    for scenario in [
        *(
            Scenario(
                f"llama-1b-4090-{mbit}mbit",
                **LLAMA_1B,
                microbatch=4,
                gpu_flops=RTX_4090,
                utilisation=0.4,
                link_bits=mbit * 1e6,
                delay=0.05,
            )
            for mbit in (200, 50, 20)
        ),
        # a Llama-2 7B shape in 8 stages of 4 layers
        Scenario(
            "llama-7b-4090-50mbit",
            width=4096,
            depth=32,
            stages=8,
            intermediate=11008,
            kv_width=4096,
            context=2048,
            microbatch=4,
            gpu_flops=RTX_4090,
            utilisation=0.4,
            link_bits=50e6,
            delay=0.05,
        ),
        # Protocol NanoGPT's setting: a 204M model of width 1024 and 8 layers, one per stage, on H100s
        Scenario(
            "nanogpt-h100-200mbit",
            width=1024,
            depth=8,
            stages=8,
            intermediate=4096,
            kv_width=1024,
            context=1024,
            microbatch=16,
            gpu_flops=H100,
            utilisation=0.4,
            link_bits=200e6,
            delay=0.05,
            checkpointing=False,
        ),
    ]
}
