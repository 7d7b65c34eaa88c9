"""Property-based tests: random start/stop/exception sequences over several kinds of targets.

Whatever the order, the visible value of each target is the newest live patch's
value, and once everything is stopped every target is exactly as before: the same
objects, in the same dictionaries, in the same order.
"""

from __future__ import annotations

import types

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

import layerswap


class Base:
    inherited = "base-value"

    @staticmethod
    def described():
        return "static"


class Child(Base):
    pass


module = types.ModuleType("layerswap_property_target")
module.GLOBAL = "global-value"
network = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.ReLU(), torch.nn.Linear(1, 1))

# (owner, attribute, how to read the raw value that a user would see)
TARGETS = {
    "module-global": (module, "GLOBAL"),
    "inherited-class-attribute": (Child, "inherited"),
    "descriptor": (Base, "described"),
    "nn-module-child": (network, "1"),
}


def raw(owner, name):
    if isinstance(owner, torch.nn.Module):
        return owner._modules.get(name, owner.__dict__.get(name))
    return owner.__dict__.get(name, "<absent>")


def snapshot():
    return {
        "module": dict(module.__dict__),
        "child": dict(Child.__dict__),
        "base": dict(Base.__dict__),
        "network_modules": list(network._modules.items()),
        "network_dict_keys": set(network.__dict__),
    }


class PatchStacks(RuleBasedStateMachine):
    live = Bundle("live")

    def __init__(self):
        super().__init__()
        self.before = snapshot()
        self.started = []  # (target key, patch, value) in start order
        self.counter = 0

    def _value(self, key):
        self.counter += 1
        return torch.nn.Identity() if key == "nn-module-child" else f"{key}-{self.counter}"

    @rule(target=live, key=st.sampled_from(sorted(TARGETS)))
    def start(self, key):
        owner, name = TARGETS[key]
        value = self._value(key)
        entry = (key, layerswap.patch(owner, name, value).start(), value)
        self.started.append(entry)
        return entry

    @rule(entry=live)
    def stop(self, entry):
        entry[1].stop()  # stopping twice (same entry drawn again) must be a no-op
        if entry in self.started:
            self.started.remove(entry)

    @rule(key=st.sampled_from(sorted(TARGETS)))
    def raise_inside_with(self, key):
        owner, name = TARGETS[key]
        try:
            with layerswap.patch(owner, name, self._value(key)):
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass

    @invariant()
    def visible_value_is_the_newest_live_patch(self):
        for key, (owner, name) in TARGETS.items():
            live = [value for k, _, value in self.started if k == key]
            if live:
                assert raw(owner, name) is live[-1]
        if not self.started:
            assert snapshot_equal(snapshot(), self.before)

    def teardown(self):
        for _, p, _ in reversed(self.started):
            p.stop()
        assert snapshot_equal(snapshot(), self.before)
        assert layerswap.active_patches() == []


def snapshot_equal(a, b):
    if a.keys() != b.keys():
        return False
    for key in a:
        if key == "network_modules":
            if [(n, id(m)) for n, m in a[key]] != [(n, id(m)) for n, m in b[key]]:
                return False
        elif key == "network_dict_keys":
            if a[key] != b[key]:
                return False
        else:
            if a[key].keys() != b[key].keys():
                return False
            if any(a[key][k] is not b[key][k] for k in a[key]):
                return False
    return True


PatchStacks.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_patch_stacks = PatchStacks.TestCase
