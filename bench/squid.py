"""What both squids of the bench are told, whichever way they proxy."""

SQUID_COMMON = """
acl localnet src 10.232.2.0/24
http_access allow localnet
http_access deny all
cache deny all
cache_mem 8 MB
access_log none
cache_store_log none
cache_log {dir}/{name}-cache.log
pid_filename {dir}/{name}.pid
coredump_dir {dir}/{name}
visible_hostname corral-bench-{name}
dns_nameservers {up}
icp_port 0
htcp_port 0
pinger_enable off
shutdown_lifetime 0 seconds
via off
forwarded_for delete
"""
"""What both squids of the bench say (the plain one in run.py, the ssl-bump one in
inspected.py)."""
