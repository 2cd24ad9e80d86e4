"""The filter's worker processes (`[filter] workers`): sessions sharded across processes,
so that a team's sessions use every core.

  replica.py      pure   which worker serves a session; what of a change each is sent
  link.py         edge   frames (and descriptors) between the coordinator and a worker
  coordinator.py  edge   starts the workers, tells them changes, restarts one that died
  worker.py       edge   one worker: DNS filter and proxy for its shard's gateways

With `workers = 1` (the default) there is no worker process: the filter serves every
session itself, as it always has.
"""
