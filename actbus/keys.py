"""``actbus keys DIR [--client NAME]``: CURVE certificates for the publisher and its
subscribers (``actbus.bus.security.generate_keys``), and where each file goes."""

from __future__ import annotations

import argparse
import sys

from actbus.bus.security import generate_keys
from actbus.errors import ConfigError
from actbus.flags import HelpFormatter


def main(argv: list[str]) -> int:
    """make CURVE keys: a publisher keypair and one per subscriber"""
    p = argparse.ArgumentParser(
        prog="actbus keys",
        description="Write ZeroMQ CURVE certificates into DIR: the publisher's keypair (once) "
        "and a subscriber keypair named by --client, whose public key goes into "
        "DIR/authorized_keys. Run again with another --client for each further subscriber.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("dir", help="directory for the key files (made if missing, mode 0700)")
    p.add_argument("--client", default="client", help="subscriber key name")
    args = p.parse_args(argv)
    directory, client = args.dir, args.client
    try:
        k = generate_keys(directory, client)
    except ConfigError as e:
        print(f"actbus keys: {e}", file=sys.stderr)
        return 2
    print(
        f"""CURVE keys in {directory} (secret files are mode 0600; never copy a secret off its host)
  publisher:   {k.server_secret}    secret, stays on the publisher host
               {k.authorized_keys}/   public keys of the subscribers it lets in
  subscribers: {k.server_public}           public, copy to every subscriber host
               {k.client_secret}    secret, copy to the host of subscriber {client!r} only

publisher (vLLM additional_config):
  {{"actbus": {{"publish": "tcp://0.0.0.0:5555", "layers": [...],
              "server_secret_key": "{k.server_secret}",
              "authorized_keys": "{k.authorized_keys}"}}}}
subscriber:
  actbus run NAME --connect tcp://PUBLISHER_HOST:5555 \\
      --server-key {k.server_public} --client-secret-key {k.client_secret}
another subscriber: actbus keys {directory} --client NAME2"""
    )
    return 0
