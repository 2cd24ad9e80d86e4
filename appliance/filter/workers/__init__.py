"""The filter's worker processes (`[filter] workers`): each session served by one of them,
so that a team's sessions use every core.

  replica.py      pure   which worker serves a session; what of a change each is sent
  link.py         edge   frames (and descriptors) between the coordinator and a worker

  the coordinator's side (the filter):
  coordinator.py  edge   starts the workers, tells them changes and gateways, restarts them
  process.py      edge   one worker process as the coordinator sees it
  inbox.py        edge   what the workers say, checked as if hostile

  a worker's side:
  worker.py       edge   one worker: the DNS filter and the proxy for its sessions' gateways
  confine.py      edge   what it gives up as it starts: descriptors, capabilities
  outbox.py       edge   its events and firewall teachings, to the coordinator
  holds.py        edge   ask mode in a worker: the book is the coordinator's

With `workers = 1` (the code's default) there is no worker process: the filter serves every
session itself, as it always has. docs/filter.md ("Workers") is the user's account.
"""
