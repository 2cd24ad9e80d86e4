"""Sandboxes: the agent's hardened podman containers. `podman.py` is the only code that runs
podman; `image.py` builds the sandbox image from Debian packages; `hardening.py` says how a
sandbox container is started; `seccomp.py` derives its seccomp profile from podman's default
and `confinement.py` writes that profile and the sandbox's init before a session starts."""
