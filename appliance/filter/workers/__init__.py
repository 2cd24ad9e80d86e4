"""The filter's worker processes (`[filter] workers`): each session served by one of them,
so that a team's sessions use every core.

  replica.py      pure   which worker serves a session; what of a change each is sent
  link.py         edge   frames (and descriptors) between the coordinator and a worker
  coordinator.py  edge   starts the workers, tells them changes, restarts one that died,
                         checks everything they say
  worker.py       edge   one worker: the DNS filter and the proxy for its sessions' gateways
  holds.py        edge   ask mode in a worker: the book is the coordinator's

With `workers = 1` (the code's default) there is no worker process: the filter serves every
session itself, as it always has. docs/filter.md ("Workers") is the user's account.
"""
