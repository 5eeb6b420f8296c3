# swarm-peer in a container: docker run --gpus all -v swarm-data:/data IMAGE --join URL
# (README.md, "Run it in a container"). The base is plain Python: PyPI's torch wheels for Linux carry their own
# CUDA runtime, so the image needs no CUDA base and works with any recent NVIDIA driver on the host
# (--gpus all needs the NVIDIA Container Toolkit there); on a machine without a GPU it serves on the CPU.
FROM python:3.11-slim

# the project's code, installed like a user would (not editable); tests and benchmarks stay out
WORKDIR /opt/swarm
COPY pyproject.toml README.md ./
COPY swarm ./swarm
COPY peers ./peers
COPY examples ./examples
RUN pip install --no-cache-dir "torch>=2.1,<2.15" && pip install --no-cache-dir .

# what a restarted container keeps: the peer's identity key (the same peer id, so manifests naming this peer's
# address stay valid), the throughput cache (no new measurement), checkpoints and tokenizers
ENV SWARM_CACHE_DIR=/data/cache
VOLUME ["/data"]
# a fixed port, to publish with -p 31337:31337 (the peer says whether others can dial it)
EXPOSE 31337

ENTRYPOINT ["swarm-peer", "--identity", "/data/identity.key", "--host-maddrs", "/ip4/0.0.0.0/tcp/31337"]
CMD ["--help"]
