"""What a seccomp profile in containers-common's format decides for one call, as podman and
runc apply it: podman keeps the rules whose includes/excludes (capabilities, architecture)
fit the container, runc turns each into a libseccomp rule, a rule matches when all of its
argument tests do, and no matching rule means the default action.

Where two matching rules disagree, libseccomp's answer depends on the order it builds its
filter in: `decide` reports that as None, and tests require corral's rules never to do it.
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1


def _arg_matches(test: dict, args: tuple[int, ...]) -> bool:
    value = args[test["index"]] & MASK64
    op, a, b = test["op"], test["value"], test.get("valueTwo", 0)
    if op == "SCMP_CMP_MASKED_EQ":
        return value & a == b
    return {"SCMP_CMP_EQ": value == a, "SCMP_CMP_NE": value != a, "SCMP_CMP_LT": value < a,
            "SCMP_CMP_LE": value <= a, "SCMP_CMP_GT": value > a,
            "SCMP_CMP_GE": value >= a}[op]


def _applies(rule: dict, caps: frozenset[str], arch: str) -> bool:
    includes, excludes = rule.get("includes") or {}, rule.get("excludes") or {}
    if arch in (excludes.get("arches") or []):
        return False
    if any(c in caps for c in excludes.get("caps") or []):
        return False
    if includes.get("arches") and arch not in includes["arches"]:
        return False
    return all(c in caps for c in includes.get("caps") or [])


def decide(profile: dict, name: str, args: tuple[int, ...] = (0,) * 6,
           caps: frozenset[str] = frozenset(), arch: str = "amd64"
           ) -> tuple[str, int | None] | None:
    """(action, errno) for `name(args)`, or None where matching rules disagree."""
    args = (*args, *(0,) * (6 - len(args)))
    found = set()
    for rule in profile["syscalls"]:
        names = rule["names"] if "names" in rule else [rule["name"]]  # Docker's old spelling
        if name in names and _applies(rule, caps, arch) and all(
                _arg_matches(t, args) for t in rule.get("args") or []):
            found.add((rule["action"], rule.get("errnoRet")))
    if len(found) > 1:
        return None
    if found:
        return found.pop()
    return profile["defaultAction"], profile.get("defaultErrnoRet")
