"""A subscriber that asks for the lossless policy and then never reads or grants credit."""

import sys
import time

from actbus.bus import Subscriber, Subscription

sub = Subscriber(sys.argv[1], Subscription(policy="block", window=1, name="stuck"))
sub.wait_welcome(60)
print("ready", flush=True)
time.sleep(600)
