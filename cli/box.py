"""`corral box build`: a Debian 13 libvirt box from Debian packages alone (mmdebstrap), so
there is no third-party image to trust.

  mmdebstrap trixie -> ext4 on a loop device at the partition's offset -> extlinux ->
  qcow2 -> a vagrant-libvirt box (metadata.json, Vagrantfile, box.img) -> `vagrant box add`

The appliance's Debian packages are baked in (read from the roles' defaults), so the
playbooks' apt tasks find them installed: under TCG an install costs minutes. So is corral's
venv, made by corral_base's own commands from the locked wheels (the box's Python): a box
built from the commit being provisioned leaves that role nothing to install. The image
also serves the VM tests, which boot the qcow2 directly. Needs root (loop devices, mount).
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import exitcodes, output
from .client import CliError
from .local import containers_conf

ROOT = Path(__file__).resolve().parents[1]
RELEASE = "debian13"
BOX_NAME = f"corral/{RELEASE}"
SUITE = "trixie"
PYTHON = "3.13"
"""The suite's python3: the version the baked wheels are collected for."""
IMAGE = f"{RELEASE}.qcow2"
"""The image's file name in the cache (the VM tests boot it too)."""
BOOT_PACKAGES = ("linux-image-cloud-amd64", "systemd-sysv", "systemd-resolved", "udev", "dbus",
                 "openssh-server", "python3", "python3-apt", "sudo", "iproute2", "netbase",
                 "ca-certificates", "less", "iputils-ping")
TOOLS = {"mmdebstrap": "mmdebstrap", "extlinux": "extlinux", "sfdisk": "fdisk",
         "qemu-img": "qemu-utils", "mkfs.ext4": "e2fsprogs", "losetup": "mount"}
MBR = Path("/usr/lib/syslinux/mbr/mbr.bin")
# appliance.sandbox.image's BASE and IMAGE (the CLI does not import it; a test keeps them equal)
SANDBOX_IMAGES = ("localhost/corral-base:2", "localhost/corral-sandbox:2")
INSECURE_KEYS = "/usr/share/rubygems-integration/all/gems/vagrant-*/keys/vagrant.pub"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "corral" / "box"


def appliance_packages() -> list[str]:
    """Every Debian package the roles install: their defaults are the one list."""
    return [*role_defaults("corral_base")["corral_base_packages"],
            *role_defaults("corral_sandbox")["corral_sandbox_packages"], "nftables"]


def missing_tools() -> list[str]:
    problems = [f"{tool} is missing: apt-get install {package}"
                for tool, package in TOOLS.items() if shutil.which(tool) is None]
    if not MBR.exists():
        problems.append("syslinux's MBR code is missing: apt-get install syslinux-common")
    if os.geteuid() != 0:
        problems.append("building a disk image needs root (loop devices, mount): "
                        "`sudo corral box build`")
    return problems


def _run(*argv: str, timeout: float = 600, **kwargs) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if result.returncode != 0:
        raise CliError(f"{argv[0]} failed (exit {result.returncode}): "
                       f"{(result.stderr or result.stdout).strip()[-1500:]}",
                       "see the message above; the partial image was removed")
    return result.stdout


def build_image(out: Path, keys: list[Path], size: str = "12G",
                mirror: str = "http://deb.debian.org/debian", progress=output.notice,
                sandbox_images: Path | None = None) -> Path:
    """A bootable qcow2 at out/IMAGE, user `vagrant` (NOPASSWD sudo) with `keys`;
    with `sandbox_images` (a `podman save -m` archive) loaded into its podman storage."""
    problems = missing_tools()
    if problems:
        raise CliError("cannot build the box:\n  " + "\n  ".join(problems),
                       "fix the above and run `corral box build` again", exitcodes.NOT_CONFIGURED)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def phase(text):
        progress(f"[{time.monotonic() - started:5.1f}s] {text}")

    with tempfile.TemporaryDirectory(dir=out, prefix="build-") as tmp:
        work = Path(tmp)
        raw, mnt = work / "disk.raw", work / "mnt"
        mnt.mkdir()
        (work / "authorized_keys").write_text("".join(k.read_text() for k in keys))
        _run("truncate", "-s", size, str(raw))
        _run("sfdisk", "-q", str(raw), input="start=2048, type=83, bootable\n")
        # no udev here: attach the loop device at the partition's offset, not with -P
        loop = _run("losetup", "--show", "-f", "-o", str(2048 * 512), str(raw)).strip()
        try:
            _run("mkfs.ext4", "-q", "-L", "root", "-O", "^64bit", loop)
            uuid = _run("blkid", "-s", "UUID", "-o", "value", loop).strip()
            _run("mount", loop, str(mnt))
            try:
                phase("collecting corral's wheels, as corral_base does (the locked ones)")
                wheelhouse = collect_wheels(work / "wheelhouse")
                phase(f"mmdebstrap {SUITE} with the appliance's packages and corral's venv "
                      "(a few minutes)")
                _mmdebstrap(mnt, work / "authorized_keys", uuid, mirror, wheelhouse)
                _bootloader(mnt, uuid)
                images = {}
                if sandbox_images is not None:
                    phase("loading the sandbox image into the box's podman storage")
                    images = _preload(mnt, sandbox_images, work)
                record = _record(mnt, images, out)
            finally:
                _run("umount", "-R", str(mnt))
        finally:
            subprocess.run(["losetup", "-d", loop], check=False)
        with open(raw, "r+b") as disk:  # MBR boot code: the first 440 bytes, table kept
            disk.write(MBR.read_bytes()[:440])
        phase("converting to qcow2")
        image = out / IMAGE
        _run("qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(image) + ".new")
        os.replace(str(image) + ".new", image)
    phase(f"image ready: {image} (its packages and images: {record})")
    return image


def _record(root: Path, images: dict[str, str], out: Path) -> Path:
    """What the box holds (each Debian package's version and architecture, the sandbox
    images' ids) beside it in `out` and inside it (/usr/share/corral/box.json), so that two
    boxes built from one commit can be compared and an appliance names its box."""
    from appliance.manifest import box_manifest, dpkg_query, dumps

    listed = _run(*dpkg_query(admindir=str(root / "var/lib/dpkg")))
    data = dumps(box_manifest(listed, images))
    inside = root / "usr/share/corral/box.json"
    inside.parent.mkdir(parents=True, exist_ok=True)
    inside.write_bytes(data)
    beside = out / f"{RELEASE}.json"
    beside.write_bytes(data)
    return beside


def every_task(items) -> list[dict]:
    """Every task of a tasks file, those in blocks (block, rescue, always) included."""
    found = []
    for task in items or []:
        found.append(task)
        for key in ("block", "rescue", "always"):
            found += every_task(task.get(key))
    return found


def role_defaults(role: str) -> dict:
    import yaml  # from ansible-core; only this command needs it

    return yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text())


def role_command(name_start: str) -> str:
    """The shell command of the corral_base task whose name starts so: the box runs the
    role's own commands, so that provisioning finds what they made current."""
    import yaml  # from ansible-core; only this command needs it

    tasks = yaml.safe_load((ROOT / "roles/corral_base/tasks/main.yml").read_text())
    (task,) = [t for t in every_task(tasks) if t["name"].startswith(name_start)]
    return task["ansible.builtin.shell"]["cmd"]


def collect_wheels(wheelhouse: Path) -> Path:
    """corral's wheel and the locked wheels it needs, for the box's Python, as one archive
    (corral_base's own command, run as the role runs it on the control machine): byte for
    byte the archive provisioning copies, so the role's copy and install find them there."""
    env = {**os.environ, "PYTHON": sys.executable, "SOURCE": str(ROOT),
           "WHEELHOUSE": str(wheelhouse), "ARCH": os.uname().machine, "PYVER": PYTHON,
           "SOURCE_DATE_EPOCH": "315532800"}
    _run("sh", "-c", role_command("Build the corral wheel"), env=env, timeout=900)
    return wheelhouse.with_name(wheelhouse.name + ".tar")


FACT = ROOT / "roles/corral_base/templates/etc/ansible/facts.d/corral.fact.j2"
HOST_KEYS_UNIT = """[Unit]
Description=SSH host keys of this VM's own (the box carries none)
Before=ssh.service ssh.socket

[Service]
Type=oneshot
ExecStart=/bin/sh -c 'for t in ed25519 ecdsa; do k=/etc/ssh/ssh_host_$${t}_key; \\
    [ -s "$$k" ] || ssh-keygen -q -t "$$t" -N "" -f "$$k" </dev/null || exit 1; done'

[Install]
WantedBy=ssh.service ssh.socket multi-user.target
"""
"""Made on a VM's first boot: a box's keys would be every VM's (see _mmdebstrap)."""
RESOLVED = ROOT / "roles/corral_filter/templates/etc/systemd/resolved.conf.d/corral.conf.j2"


def fact_script(prefix: str) -> str:
    """corral_base's fact as the role renders it for `prefix` (its one variable)."""
    return FACT.read_text().replace("{{ corral_base_prefix }}", prefix)


def baked_as_provisioned(fact: Path) -> list[str]:
    """mmdebstrap hooks that make what the roles make the same way whatever the team's
    variables are, with the roles' defaults: their state fact, the services' users and
    groups, corral's directories, resolved without its stub. Provisioning's checks then find
    them current and skip them; a team's other values are made by the roles as on any host."""
    base = role_defaults("corral_base")
    prefix, group = base["corral_base_prefix"], base["corral_base_control_group"]
    filter_user, api_user = base["corral_base_filter_user"], base["corral_base_api_user"]
    nologin = "--shell /usr/sbin/nologin --home-dir /nonexistent --no-create-home"
    return [
        f'install -D -m 0755 {fact} "$1/etc/ansible/facts.d/corral.fact"',
        f'chroot "$1" groupadd --system {group}; chroot "$1" groupadd --system {api_user}',
        f'chroot "$1" useradd --system --gid {group} {nologin} {filter_user}',
        f'chroot "$1" useradd --system --gid {api_user} --groups {group} {nologin} {api_user}',
        'install -d -m 0755 "$1/etc/corral"',
        f'install -D -m 0644 {RESOLVED} "$1/etc/systemd/resolved.conf.d/corral.conf"',
        'ln -sf /run/systemd/resolve/resolv.conf "$1/etc/resolv.conf"',
        f'ln -s /usr/lib/python3/dist-packages/nftables '
        f'"$1{prefix}/venv/lib/python{PYTHON}/site-packages/nftables"',
    ]


def _mmdebstrap(root: Path, keys: Path, uuid: str, mirror: str, wheelhouse: Path) -> None:
    packages = sorted({*BOOT_PACKAGES, *appliance_packages()})
    install = role_command("Install corral into its virtualenv")
    prefix = role_defaults("corral_base")["corral_base_prefix"]
    fact = wheelhouse.with_name("corral.fact")
    fact.write_text(fact_script(prefix))
    hooks = [
        # initramfs regeneration costs minutes under TCG; the image's own was made here
        'mkdir -p "$1/etc/initramfs-tools/conf.d"; '
        'echo COMPRESS=gzip > "$1/etc/initramfs-tools/conf.d/compress"',
    ]
    customize = [
        f'cp {keys} "$1/tmp/authorized_keys"',
        'chroot "$1" useradd -m -s /bin/bash -G sudo vagrant',
        'echo "vagrant ALL=(ALL) NOPASSWD:ALL" > "$1/etc/sudoers.d/vagrant"; '
        'chmod 0440 "$1/etc/sudoers.d/vagrant"',
        'install -d -m 700 -o 1000 -g 1000 "$1/home/vagrant/.ssh"; install -m 600 -o 1000 '
        '-g 1000 "$1/tmp/authorized_keys" "$1/home/vagrant/.ssh/authorized_keys"; '
        'rm "$1/tmp/authorized_keys"',
        'echo corral > "$1/etc/hostname"; '
        'printf "127.0.0.1 localhost\\n127.0.1.1 corral\\n" > "$1/etc/hosts"',
        f'echo "UUID={uuid} / ext4 errors=remount-ro 0 1" > "$1/etc/fstab"',
        'printf "[Match]\\nName=en* eth*\\n\\n[Network]\\nDHCP=yes\\n" > '
        '"$1/etc/systemd/network/80-dhcp.network"',
        'chroot "$1" systemctl enable systemd-networkd systemd-resolved ssh',
        f'printf "deb http://deb.debian.org/debian {SUITE} main\\n'
        f'deb http://deb.debian.org/debian {SUITE}-updates main\\n'
        f'deb http://deb.debian.org/debian-security {SUITE}-security main\\n" > '
        '"$1/etc/apt/sources.list"',
        'printf "UseDNS no\\n" > "$1/etc/ssh/sshd_config.d/10-corral.conf"',
        # no host keys in the box: openssh-server's postinst made some here, and every VM
        # from this box would answer with them (so a pinned key could not tell one VM from
        # another). Each VM makes its own on its first boot, before sshd starts: ed25519
        # and ECDSA only (an RSA key takes seconds to make under TCG), and sshd is told so.
        'rm -f "$1"/etc/ssh/ssh_host_*',
        'printf "HostKey /etc/ssh/ssh_host_ed25519_key\\nHostKey /etc/ssh/ssh_host_ecdsa_key\\n" '
        '> "$1/etc/ssh/sshd_config.d/05-corral-host-keys.conf"',
        f'printf %s {shlex.quote(HOST_KEYS_UNIT)} > '
        '"$1/etc/systemd/system/corral-ssh-host-keys.service"',
        'chroot "$1" systemctl enable corral-ssh-host-keys.service',
        'sed -i "s/^update_initramfs=.*/update_initramfs=no/" '
        '"$1/etc/initramfs-tools/update-initramfs.conf"',
        # corral's venv as corral_base makes it (its default prefix), from the same archive:
        # under TCG that install costs provisioning minutes
        f'install -d -m 0755 "$1{prefix}"',
        f'install -m 0644 {wheelhouse} "$1{prefix}/wheelhouse.tar"',
        f'chroot "$1" sh -c {shlex.quote(f"cd {prefix} && " + install)}',
        'rm -rf "$1/root/.cache/pip"',
        *baked_as_provisioned(fact),
    ]
    _run("mmdebstrap", "--variant=minbase", f"--include={','.join(packages)}",
         '--aptopt=Acquire::Retries "3"',
         *[f"--setup-hook={h}" for h in hooks], *[f"--customize-hook={h}" for h in customize],
         SUITE, str(root), mirror, timeout=1800)
    # mmdebstrap leaves the package lists empty but "fresh", so apt's cache_valid_time skips
    # the update. Kept so on purpose: every package the roles install is baked in (a unit
    # test keeps it so), and an update costs minutes under emulation.


def _preload(root: Path, archive: Path, work: Path) -> dict[str, str]:
    """The sandbox image, put into the image's own podman storage by this host's podman (the
    same overlay driver the appliance's podman uses): under emulation, copying and loading
    it into a running VM takes minutes; here, seconds. corral_sandbox then finds it current.
    Returns the sandbox images' ids, by name."""
    storage = root / "var/lib/containers/storage"
    podman = ["podman", "--root", str(storage), "--runroot", str(work / "runroot"),
              "--storage-driver", "overlay"]
    _run(*podman, "load", "--input", str(archive), timeout=900)
    listed = json.loads(_run(*podman, "images", "--format", "json") or "[]")
    # libpod's database remembers the paths it was made with (this host's mount point) and
    # would override the appliance's own; it holds no images, so the appliance starts anew.
    shutil.rmtree(storage / "libpod")
    return {name: f"sha256:{image['Id']}" for image in listed
            for name in image.get("Names") or [] if name in SANDBOX_IMAGES}


def _bootloader(root: Path, uuid: str) -> None:
    kernel = sorted(p.name.removeprefix("vmlinuz-") for p in (root / "boot").glob("vmlinuz-*"))[-1]
    (root / "boot/extlinux").mkdir(exist_ok=True)
    (root / "boot/extlinux/extlinux.conf").write_text(
        "DEFAULT debian\nTIMEOUT 0\nPROMPT 0\nSERIAL 0 115200\nLABEL debian\n"
        f"  LINUX /boot/vmlinuz-{kernel}\n  INITRD /boot/initrd.img-{kernel}\n"
        f"  APPEND root=UUID={uuid} ro console=ttyS0,115200n8 net.ifnames=0 quiet\n")
    _run("extlinux", "--install", str(root / "boot/extlinux"))


def package_box(image: Path, out: Path) -> Path:
    """The qcow2 as a vagrant-libvirt box (uncompressed: gzip costs more than it saves)."""
    info = json.loads(_run("qemu-img", "info", "--output=json", str(image)))
    staging = out / "box"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _run("cp", "--sparse=always", str(image), str(staging / "box.img"))
    (staging / "metadata.json").write_text(json.dumps(
        {"provider": "libvirt", "format": "qcow2",
         "virtual_size": -(-info["virtual-size"] // 2**30)}))
    (staging / "Vagrantfile").write_text(
        'Vagrant.configure("2") do |config|\n  config.vm.provider :libvirt do |lv|\n'
        '    lv.driver = "kvm"\n  end\nend\n')
    box = out / f"{RELEASE}-libvirt.box"
    _run("tar", "-C", str(staging), "-cf", str(box), "metadata.json", "Vagrantfile", "box.img")
    shutil.rmtree(staging)
    return box


def sandbox_archive(out: Path, progress=output.notice) -> Path | None:
    """The sandbox images (base and layer) built on this host and saved for the box, where
    root, podman and mmdebstrap allow it; None where they do not (the VM builds its own)."""
    if os.geteuid() != 0 or shutil.which("podman") is None or shutil.which("mmdebstrap") is None:
        progress("the sandbox image will be built inside the VM (slow under emulation)")
        return None
    bin_dir = Path(sys.executable).parent
    conf = out / "containers.conf"
    conf.write_text(containers_conf(out))  # the local backend's podman
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    progress("sandbox image (built from Debian packages on this host the first time)")
    if subprocess.call([str(bin_dir / "corral-sandbox"), "image", "build"], env=env) != 0:
        raise CliError("the sandbox image build failed", "see its output above")
    archive = out / "sandbox-images.tar"
    archive.unlink(missing_ok=True)
    _run("podman", "save", "--multi-image-archive", "--output", str(archive), *SANDBOX_IMAGES,
         env=env, timeout=900)
    return archive


def cmd_build(args) -> int:
    out = Path(args.output) if args.output else cache_dir()
    image = out / IMAGE
    if image.exists() and not args.rebuild:
        output.notice(f"image {image} is there (--rebuild makes a new one)")
    else:
        keys = [Path(p) for p in sorted(glob.glob(INSECURE_KEYS))[-1:]]  # swapped at first up
        keys += [Path(k) for k in args.key or []]
        if not keys:
            raise CliError("no SSH key to put in the box", "install vagrant (its insecure key "
                           "is swapped on first boot) or pass --key FILE.pub", exitcodes.USAGE)
        out.mkdir(parents=True, exist_ok=True)
        archive = sandbox_archive(out)
        build_image(out, keys, sandbox_images=archive)
        if archive is not None:
            archive.unlink()
    if args.no_add:
        return exitcodes.OK
    box = package_box(image, out)
    output.notice(f"adding {box} to vagrant as {BOX_NAME}")
    code = subprocess.call(["vagrant", "box", "add", "--force", "--name", BOX_NAME, str(box)])
    box.unlink()
    if code != 0:
        raise CliError(f"`vagrant box add` failed (exit {code})", "see its output above")
    output.line(f"box {BOX_NAME} is ready: `corral up` uses it")
    return exitcodes.OK


def register(sub) -> None:
    box_parser = sub.add_parser("box", help="the Debian 13 box the VM is made from")
    box_sub = box_parser.add_subparsers(dest="box_command", required=True, metavar="COMMAND")
    box_build = box_sub.add_parser(
        "build", help="build the box from Debian packages (mmdebstrap; root) and add it to "
        "vagrant", description="Build a Debian 13 (trixie) libvirt box from Debian packages "
        f"alone, with the appliance's packages baked in, and add it to vagrant as {BOX_NAME}.")
    box_build.add_argument("--output", metavar="DIR", help="default: ~/.cache/corral/box")
    box_build.add_argument("--rebuild", action="store_true", help="even when an image is there")
    box_build.add_argument("--key", action="append", metavar="FILE.pub",
                           help="another SSH public key for the vagrant user (repeatable)")
    box_build.add_argument("--no-add", action="store_true",
                           help="only build the image, do not add the box to vagrant")
    box_build.set_defaults(run=cmd_build)
