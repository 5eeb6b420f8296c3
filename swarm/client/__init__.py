"""What calls other peers' stages. It imports swarm/wire/ for the contract and never swarm/server/.

- rpc.py: every call to another peer (stage calls, probes, ping, state, manifest and tokenizer downloads).
- trainer.py: the trainer loop; pipeline.py: the parts its two pipelines share; forwarded.py: the forward pipeline
  (stages pass microbatches on); relay.py: the relay pipeline (the trainer carries activations).
- window.py: how many microbatches are in flight; checks.py: checked work (the same microbatch by two routes).
- pinger.py: round trips that refine this peer's network coordinate.
- joining.py: joining through what --join names (a manifest's path or URL, or a running peer's multiaddr).
- export.py: downloading every stage's parameters from a running swarm and assembling the whole model.
"""
