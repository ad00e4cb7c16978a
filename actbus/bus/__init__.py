"""The bus: a publisher inside vLLM and subscribers in their own processes."""

from actbus.bus.protocol import POLICIES, Subscription
from actbus.bus.publisher import Publisher
from actbus.bus.subscriber import Batch, Event, Subscriber, SubscriptionRejected

__all__ = [
    "POLICIES",
    "Batch",
    "Event",
    "Publisher",
    "Subscriber",
    "Subscription",
    "SubscriptionRejected",
]
