"""RL weight-update broadcast: a trainer publishes versions of named tensors; rollout engines
pull them over the transfer engine, fanning out so the trainer's link is not the bottleneck.

    pub = Publisher(model.state_dict()); pub.publish(1)          # trainer
    weights = Subscriber(pub.address).pull(1)                    # each engine
"""

from tidekv.weights.publisher import Publisher
from tidekv.weights.subscriber import PulledWeights, Subscriber

__all__ = ["Publisher", "PulledWeights", "Subscriber"]
