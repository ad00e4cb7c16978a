"""The bus: a publisher inside vLLM and subscribers in their own processes."""

from actbus.bus.fanin import FanIn, subscribe
from actbus.bus.protocol import POLICIES, Subscription
from actbus.bus.publisher import Publisher
from actbus.bus.subscriber import Batch, Event, Source, Subscriber, SubscriptionRejected

__all__ = [
    "POLICIES",
    "Batch",
    "Event",
    "FanIn",
    "Publisher",
    "Source",
    "Subscriber",
    "Subscription",
    "SubscriptionRejected",
    "subscribe",
]
