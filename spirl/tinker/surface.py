"""The SDK's public surface, handled in full: every public member of Tinker's four client classes is
either implemented by SPIRL's subclass or refused by it in one line; nothing falls through to the
SDK's networked code.

`sdk_surface(SDKClass, refused)` is the class decorator that makes that so for one client class:

- each name in `refused` becomes a method (or property) that raises `Refused` naming the method and
  why the local backend has no meaning for it (billing, a web console, a hosted registry, ...);
- any public member of the SDK class that the subclass still does not define (a method a newer SDK
  added) is refused the same way, so a user never reaches the network; those names are listed in
  `cls.__spirl_unhandled__`, which tests/test_tinker_surface.py requires to be empty, so a new SDK
  version fails the test until each new method is implemented or refused on purpose;
- where the SDK marks a method `@deprecated` (its `_async` twins, `load_state*`, ...), SPIRL's
  override warns with the SDK's own message and category, as the SDK does.

Why a decorator and not hand-written stubs: the SDK has 100+ public members across the four classes;
one table per class (next to the class) says what is refused and why, and the rest is checked by
introspection rather than remembered.
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect

from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture
from typing_extensions import deprecated


def done_future(value) -> AwaitableConcurrentFuture:
    """The SDK's future, already holding `value`."""
    f = cf.Future()
    f.set_result(value)
    return AwaitableConcurrentFuture(f)


class Refused(NotImplementedError):
    """An SDK method that SPIRL's local backend does not serve; the message says which and why."""


def public_members(sdk_cls: type) -> list[str]:
    """The public names of an SDK class (its own and inherited), as a user sees them."""
    return sorted(n for n in dir(sdk_cls) if not n.startswith("_"))


def _refusal(qualname: str, reason: str, static: bool):
    def refused(*args, **kwargs):
        raise Refused(f"{qualname}: not served by SPIRL's local Tinker backend: {reason}")

    refused.__name__ = qualname.rsplit(".", 1)[-1]
    refused.__qualname__ = qualname
    refused.__doc__ = f"Refused: {reason}"
    refused.__spirl_refusal__ = reason
    return staticmethod(refused) if static else refused


def _refused_property(qualname: str, reason: str):
    def get(self):
        raise Refused(f"{qualname}: not served by SPIRL's local Tinker backend: {reason}")

    get.__spirl_refusal__ = reason
    return property(get, doc=f"Refused: {reason}")


def refusal_reason(cls: type, name: str) -> str | None:
    """Why `cls.name` is refused, or None if SPIRL implements it."""
    member = inspect.getattr_static(cls, name)
    fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
    return getattr(fn, "__spirl_refusal__", None)


def _sdk_deprecation(sdk_member):
    fn = getattr(sdk_member, "__func__", sdk_member)
    return getattr(fn, "__deprecated__", None)


def sdk_surface(sdk_cls: type, refused: dict[str, str]):
    """Class decorator: see the module docstring. `refused` maps SDK member names to the reason."""

    def decorate(cls: type) -> type:
        own = vars(cls)
        unhandled = []
        for name in public_members(sdk_cls):
            sdk_member = inspect.getattr_static(sdk_cls, name)
            qualname = f"{sdk_cls.__name__}.{name}"
            if name in refused:
                if isinstance(sdk_member, property):
                    setattr(cls, name, _refused_property(qualname, refused[name]))
                else:
                    setattr(cls, name, _refusal(qualname, refused[name], isinstance(sdk_member, staticmethod)))
                continue
            if name not in own:
                unhandled.append(name)
                reason = (f"this tinker SDK's {name} is newer than SPIRL's API (written against tinker 0.38.0); "
                          "please report it")
                setattr(cls, name, _refused_property(qualname, reason) if isinstance(sdk_member, property)
                        else _refusal(qualname, reason, isinstance(sdk_member, staticmethod)))
                continue
            message = _sdk_deprecation(sdk_member)
            if message and callable(own[name]) and not isinstance(own[name], (staticmethod, classmethod)):
                category = FutureWarning if message.startswith("DEPRECATED") else UserWarning
                setattr(cls, name, deprecated(message, category=category)(own[name]))
        stale = sorted(set(refused) - set(public_members(sdk_cls)))
        cls.__spirl_unhandled__ = tuple(unhandled)
        cls.__spirl_stale_refusals__ = tuple(stale)
        cls.__spirl_sdk_class__ = sdk_cls
        return cls

    return decorate


def forward_sync(async_name: str):
    """An `X_async` whose SDK convention is 'returns the value': awaits the sync twin's future."""

    sync_name = async_name.removesuffix("_async")

    async def twin(self, *args, **kwargs):
        return await getattr(self, sync_name)(*args, **kwargs)

    twin.__name__ = async_name
    twin.__doc__ = f"The SDK's async twin of {sync_name}: awaits its future and returns the value."
    return twin


def forward_future(async_name: str):
    """An `X_async` whose SDK convention is the 'double await': returns the sync twin's future."""

    sync_name = async_name.removesuffix("_async")

    async def twin(self, *args, **kwargs):
        return getattr(self, sync_name)(*args, **kwargs)

    twin.__name__ = async_name
    twin.__doc__ = f"The SDK's async twin of {sync_name}: returns its future (await the call, then the future)."
    return twin


def surface_table(classes: list[type]) -> str:
    """README's table of the SDK's surface: per SDK class, what SPIRL implements and what it refuses
    and why (`python -m spirl.tinker --surface` prints it; tests/test_tinker_surface.py keeps README
    equal to it)."""
    rows = ["| SDK class | public members | implemented locally | refused (why) |", "| --- | --- | --- | --- |"]
    for cls in classes:
        sdk = cls.__spirl_sdk_class__
        names = public_members(sdk)
        refused: dict[str, list[str]] = {}
        for n in names:
            reason = refusal_reason(cls, n)
            if reason:
                refused.setdefault(reason, []).append(n)
        done = [n for n in names if refusal_reason(cls, n) is None]
        why = "; ".join(f"{', '.join(f'`{n}`' for n in ns)}: {reason}" for reason, ns in refused.items()) or "none"
        rows.append(f"| `{sdk.__name__}` | {len(names)} | {len(done)}: {', '.join(f'`{n}`' for n in done)} | "
                    f"{len(names) - len(done)}: {why} |")
    return "\n".join(rows)
