"""git over smart HTTP, confined: which repositories of a host git may reach, and which refs
a push may write. Parsed once into matchers; the proxy (filter/git/http.py) reads the
protocol and asks these.

A `git` rule is `HOST REPO [REF ...] [-o OPTION ...]`, written in corral.toml as a
`[[git]]` table:

    [[git]]
    host = "github.com"
    repos = ["acme/widget", "acme/tools-*"]
    push = ["refs/heads/corral/{session}/**"]     # the default
    push_options = ["ci.skip"]                    # none by default

- **REPO**: the repository's path on the host without `.git` (`acme/widget`); `*` matches
  within one segment (`acme/*`, `acme/tools-*`). Matched exactly, case included: on a host
  that ignores case the agent writes it as listed.
- **REF**: the refs a push may create or move forward, `*` within one segment, `**` any
  number of them; `{session}` stands for the session's name. Without any: the default
  above, so that an agent's work lands on branches of its own and nothing else.
- **OPTION**: a push option the host may be sent (`git push -o ci.skip`), matched against
  the whole option as git sends it, case included; `*` matches any run of characters
  (`merge_request.title=*`). Printable ASCII without spaces (a `*` stands for them), and not
  `*` alone. Without any, a push carrying push options is refused: they ask the host to act
  beyond the refs (GitLab's `merge_request.create` and `merge_request.target=main` merge
  the session's branch into main; `ci.variable=...` steers its CI). Tables for one
  repository add up: their ref patterns and their option patterns together.
- Whatever the patterns say, a push never deletes a ref, never moves one anywhere but
  forward (a fast-forward the proxy can show from the pushed commits), and never moves a
  tag (creating one needs a pattern under `refs/tags/`).

A git rule makes its host inspected (git's requests are read inside TLS the filter ends);
it does not allow the host: that stays with http, as for `[[inspect]]`. Over SSH it is the
allowance (with a key the appliance holds for the host, `corral secret set --ssh`): the git
gateway (filter/git/sshgate.py) reaches the host for the listed repositories only, and a deny
rule naming the host still wins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SESSION = "{session}"
SSH_HOST_VARIABLE = "CORRAL_GIT_HOST"
"""What a session's ssh client sends the git gateway (SetEnv) to name the host it means."""
DEFAULT_PUSH = ("refs/heads/corral/{session}/**",)
_SEGMENT = re.compile(r"[A-Za-z0-9._\-*@+{}]+")
_REPO_SEGMENT = re.compile(r"[A-Za-z0-9._\-*~]+")
OPTION_FLAG = "-o"
"""What introduces a push option pattern in a rule's text, as on git's command line."""
MAX_OPTION = 256
_OPTION = re.compile(r"[!-~]+")
"""A push option pattern's characters: printable ASCII, no space."""


class GitRuleError(ValueError):
    """A git rule that cannot be parsed; the message says what is wrong."""


def _glob(pattern: str) -> re.Pattern[str]:
    """`*` within a segment (a lone `*`: one whole segment), `**` (a segment of its own) any
    number of segments, none included."""
    regex = ""
    for i, segment in enumerate(pattern.split("/")):
        if segment == "**":
            regex += "(?:/[^/]+)*" if i else "(?:[^/]+(?:/[^/]+)*)?"
        else:
            piece = "[^/]+" if segment == "*" else re.escape(segment).replace(r"\*", "[^/]*")
            regex += ("/" if i else "") + piece
    return re.compile(regex)


def _check(pattern: str, what: str, segment: re.Pattern[str]) -> None:
    if not pattern or pattern.startswith("/") or pattern.endswith("/") or "//" in pattern:
        raise GitRuleError(f"{what} {pattern!r}: write segments joined by '/', no leading, "
                           "trailing or doubled '/'")
    for part in pattern.split("/"):
        if part in (".", "..") or not segment.fullmatch(part):
            raise GitRuleError(f"{what} {pattern!r}: segment {part!r} is not allowed (letters, "
                               "digits, '.', '_', '-', and '*' as a glob)")
        if "**" in part and part != "**":
            raise GitRuleError(f"{what} {pattern!r}: '**' must be a segment of its own")


def check_push_option(pattern: str) -> None:
    """Raises GitRuleError unless `pattern` can name push options."""
    if not _OPTION.fullmatch(pattern):
        raise GitRuleError(f"push option {pattern!r}: write printable ASCII without spaces ('*' "
                           "matches any run of characters, spaces included)")
    if len(pattern) > MAX_OPTION:
        raise GitRuleError(f"push option {pattern[:40]!r}...: longer than {MAX_OPTION} "
                           "characters")
    if set(pattern) == {"*"}:
        raise GitRuleError(f"push option {pattern!r} would pass every option (merge requests "
                           "into main, CI variables): name the options")


def _option_glob(patterns: tuple[str, ...]) -> re.Pattern[str]:
    """One alternation of the patterns, `*` any run of characters (never matches when there
    are none)."""
    if not patterns:
        return re.compile(r"(?!)")
    return re.compile("|".join(re.escape(p).replace(r"\*", ".*") for p in patterns), re.DOTALL)


@dataclass(frozen=True, slots=True)
class GitSpec:
    """One repository pattern of a host, the refs a push to it may write and the push
    options it may carry."""

    repo: str
    pushes: tuple[str, ...] = DEFAULT_PUSH
    push_options: tuple[str, ...] = ()
    """Patterns of the push options the host may be sent; none by default."""
    _repo: re.Pattern[str] = field(default=None, compare=False, repr=False)  # type: ignore
    _options: re.Pattern[str] = field(default=None, compare=False, repr=False)  # type: ignore

    @property
    def text(self) -> str:
        words = [self.repo, *(self.pushes if self.pushes != DEFAULT_PUSH else ())]
        words += [w for option in self.push_options for w in (OPTION_FLAG, option)]
        return " ".join(words)

    @classmethod
    def parse(cls, repo: str, pushes: tuple[str, ...] | None = None,
              push_options: tuple[str, ...] = ()) -> GitSpec:
        repo = repo[:-4] if repo.lower().endswith(".git") else repo
        _check(repo, "repository", _REPO_SEGMENT)
        if "**" in repo.split("/"):
            raise GitRuleError(f"repository {repo!r}: '**' is not allowed; name the owner")
        pushes = DEFAULT_PUSH if not pushes else tuple(pushes)
        for ref in pushes:
            _check(ref.replace(SESSION, "s"), "ref pattern", _SEGMENT)
            if not ref.startswith("refs/") or ref.count("/") < 2:
                raise GitRuleError(f"ref pattern {ref!r}: name full refs, such as "
                                   "refs/heads/corral/{session}/**")
            if "{" in ref.replace(SESSION, "") or "}" in ref.replace(SESSION, ""):
                raise GitRuleError(f"ref pattern {ref!r}: the one placeholder is {SESSION}")
        for option in push_options:
            check_push_option(option)
        return cls._compiled(repo, pushes, tuple(dict.fromkeys(push_options)), _glob(repo))

    @classmethod
    def _compiled(cls, repo, pushes, push_options, compiled_repo) -> GitSpec:
        spec = cls(repo, pushes, push_options)
        object.__setattr__(spec, "_repo", compiled_repo)
        object.__setattr__(spec, "_options", _option_glob(push_options))
        return spec

    def covers(self, repo: str) -> bool:
        return self._repo.fullmatch(repo) is not None

    def push_option(self, option: str) -> bool:
        """May a push carry this push option (as git sends it)?"""
        return self._options.fullmatch(option) is not None

    def pushable(self, ref: str, session: str) -> str | None:
        """The pattern that lets `session` push `ref`, None if none does."""
        for pattern in self.pushes:
            if _ref_glob(pattern.replace(SESSION, session)).fullmatch(ref):
                return pattern
        return None


_REF_GLOBS: dict[str, re.Pattern[str]] = {}


def _ref_glob(pattern: str) -> re.Pattern[str]:
    found = _REF_GLOBS.get(pattern)
    if found is None:
        if len(_REF_GLOBS) > 4096:
            _REF_GLOBS.clear()
        found = _REF_GLOBS[pattern] = _glob(pattern)
    return found


def parse_rule_text(text: str) -> tuple[str, GitSpec]:
    """`HOST REPO [REF ...] [-o OPTION ...]` -> (host text, spec). Raises GitRuleError."""
    words = text.split()
    if len(words) < 2:
        raise GitRuleError(f"git rule {text!r} is not 'HOST REPO [REF-PATTERN ...] "
                           "[-o PUSH-OPTION ...]'")
    refs, options, rest = [], [], iter(words[2:])
    for word in rest:
        if word != OPTION_FLAG:
            refs.append(word)
        elif (option := next(rest, None)) is None:
            raise GitRuleError(f"git rule {text!r}: {OPTION_FLAG} names no push option")
        else:
            options.append(option)
    return words[0], GitSpec.parse(words[1], tuple(refs), tuple(options))


@dataclass(frozen=True, slots=True)
class GitAccess:
    """What git may do on one host: its repository patterns, in rule order."""

    host: str
    specs: tuple[GitSpec, ...]

    def repository(self, repo: str) -> GitSpec | None:
        """What may be done to `repo` (a path without `.git`): every covering spec's push
        patterns together (tables add up, whatever their layer or order), None if no spec
        covers it."""
        covering = [spec for spec in self.specs if spec.covers(repo)]
        if not covering:
            return None
        if len(covering) == 1:
            return covering[0]
        return GitSpec._compiled(
            covering[0].repo, tuple(dict.fromkeys(p for s in covering for p in s.pushes)),
            tuple(dict.fromkeys(o for s in covering for o in s.push_options)),
            covering[0]._repo)

    def listed(self) -> str:
        return ", ".join(spec.repo for spec in self.specs)


class GitHosts:
    """The git rules of a policy by host: an exact host's specs first, then those of the
    `*.suffix` wildcards above it, narrowest first."""

    __slots__ = ("_exact", "_wild")

    def __init__(self, rules):
        self._exact: dict[str, list[GitSpec]] = {}
        self._wild: dict[str, list[GitSpec]] = {}
        for rule in rules:
            table = self._wild if rule.wildcard else self._exact
            table.setdefault(rule.suffix, []).append(rule.git)

    def __bool__(self) -> bool:
        return bool(self._exact or self._wild)

    def lookup(self, host) -> GitAccess | None:
        specs = list(self._exact.get(host.key, ()))
        name = host.name
        while name is not None and self._wild and "." in name:
            name = name.split(".", 1)[1]
            specs += self._wild.get(name, ())
        return GitAccess(host.key, tuple(specs)) if specs else None
