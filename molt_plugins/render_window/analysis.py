"""The static analysis behind :func:`molt_plugins.render_window.prove_window`: a walk of a chat
template's Jinja AST that accepts only the class of templates the module doc of
:mod:`molt_plugins.render_window` describes (raising :class:`_NotProven` with the reason otherwise)."""

from __future__ import annotations

from typing import Any

__all__ = ["_Analysis", "_NotProven"]

_IMPURE = frozenset({"strftime_now", "cycler", "joiner", "lipsum", "raise_exception", "range", "self", "caller",
                     "varargs", "kwargs"})
_CMP = frozenset({"eq", "ne", "lt", "gt", "lteq", "gteq"})


class _NotProven(Exception):
    """Internal: the template is outside the class the proof covers (message = why)."""


# abstract kinds: "v" a value equal at corresponding points of window and full render;
# "idx" a loop index, "scan" a scanned last index, "msgs" the list, "len" its length,
# "loop" a messages loop's ``loop``, "ns" a namespace, "nsfunc" namespace(), "macro"


class _Analysis:
    def __init__(self, nodes: Any) -> None:
        self.n = nodes
        self.radius = 0
        self.const_max = -1
        self.scans: list[Any] = []  # (loop target name, predicate node, reverse)
        self.ns_attrs: dict[tuple[str, str], str] = {}
        self.ns_init: dict[tuple[str, str], Any] = {}
        self.main_loops = 0
        self.after_main = False
        self.ns_names: set[str] = set()

    # ---------------------------------------------------------------- statements

    def stmts(self, body: list[Any], env: dict[str, Any], ctx: dict[str, Any]) -> None:
        for s in body:
            self.stmt(s, env, ctx)

    def stmt(self, s: Any, env: dict[str, Any], ctx: dict[str, Any]) -> None:
        n = self.n
        if isinstance(s, n.Output):
            for e in s.nodes:
                if not isinstance(e, n.TemplateData):
                    self.need_v(e, env, ctx)
        elif isinstance(s, n.If):
            self.need_v(s.test, env, ctx)
            self.stmts(s.body, env, ctx)
            for e in s.elif_:
                self.stmt(e, env, ctx)
            self.stmts(s.else_, env, ctx)
        elif isinstance(s, n.Assign):
            self.assign(s, env, ctx)
        elif isinstance(s, n.AssignBlock):
            if s.filter is not None or not isinstance(s.target, n.Name):
                raise _NotProven("a filtered or non-name {% set %} block")
            self.stmts(s.body, dict(env), {**ctx, "depth": ctx["depth"] + 1})  # captured text: never the main loop
            self.bind(s.target.name, "v", env)
        elif isinstance(s, n.For):
            self.loop(s, env, ctx)
        elif isinstance(s, n.Macro):
            if ctx["depth"] or ctx["msg_loop"]:
                raise _NotProven("a macro defined inside a block")
            menv = {k: v for k, v in env.items() if v in ("macro",)}
            for a in s.args:
                menv[a.name] = "v"
            for d in s.defaults:
                self.need_v(d, env, ctx)
            self.stmts(s.body, menv, {**ctx, "macro": True, "loop": None, "depth": 1})
            self.bind(s.name, "macro", env)
        else:
            raise _NotProven(f"the statement {type(s).__name__}")

    def bind(self, name: str, kind: str, env: dict[str, Any]) -> None:
        if name in ("messages", "loop", "add_generation_prompt", "namespace") or env.get(name) in ("ns", "macro"):
            raise _NotProven(f"a {{% set %}} rebinding {name!r}")
        env[name] = kind

    def assign(self, s: Any, env: dict[str, Any], ctx: dict[str, Any]) -> None:
        n = self.n
        t = s.target
        if isinstance(t, n.NSRef):
            if ctx["msg_loop"] or ctx["macro"]:
                raise _NotProven("a namespace attribute assigned inside a messages loop or a macro")
            if env.get(t.name) != "ns" or self.ns_attrs.get((t.name, t.attr)) == "scan":
                raise _NotProven(f"assignment to {t.name}.{t.attr}")
            self.need_v(s.node, env, ctx)
            self.ns_attrs[(t.name, t.attr)] = "v"
            self.ns_init[(t.name, t.attr)] = None  # reassigned: no longer a known constant for a scan
            return
        if not isinstance(t, n.Name):
            raise _NotProven("a tuple {% set %}")
        v = s.node
        if isinstance(v, n.Call) and isinstance(v.node, n.Name) and v.node.name == "namespace" and "namespace" not in env:
            if ctx["depth"] or ctx["msg_loop"] or ctx["macro"] or v.args or v.dyn_args or v.dyn_kwargs:
                raise _NotProven("namespace() outside the top level or with positional arguments")
            if t.name in env:
                raise _NotProven(f"namespace {t.name!r} rebound")
            for kw in v.kwargs:
                if self._last_index(kw.value):  # only a reverse scan may use it (kind "pending")
                    self.ns_attrs[(t.name, kw.key)] = "pending"
                    self.ns_init[(t.name, kw.key)] = kw.value
                    continue
                self.need_v(kw.value, env, ctx)
                self.ns_attrs[(t.name, kw.key)] = "v"
                self.ns_init[(t.name, kw.key)] = kw.value
            env[t.name] = "ns"
            return
        self.need_v(v, env, ctx)
        self.bind(t.name, "v", env)

    def loop(self, s: Any, env: dict[str, Any], ctx: dict[str, Any]) -> None:
        n = self.n
        if s.recursive:
            raise _NotProven("a recursive loop")
        is_msgs = isinstance(s.iter, n.Name) and s.iter.name == "messages" and "messages" not in env
        rev = (isinstance(s.iter, n.Getitem) and isinstance(s.iter.node, n.Name) and s.iter.node.name == "messages"
               and "messages" not in env and isinstance(s.iter.arg, n.Slice) and s.iter.arg.start is None
               and s.iter.arg.stop is None and self._int_const(s.iter.arg.step) == -1)
        if rev:
            if ctx["depth"] or ctx["msg_loop"] or ctx["macro"] or s.else_ or s.test is not None or not self.reverse_scan(s, env):
                raise _NotProven("a reversed messages loop other than a top-level last-index scan")
            return
        if not is_msgs:
            self.need_v(s.iter, env, ctx)
            inner = dict(env)
            self.targets(s.target, inner)
            inner_ctx = {**ctx, "loop": "v", "depth": ctx["depth"] + 1}
            if s.test is not None:
                self.need_v(s.test, inner, inner_ctx)
            self.stmts(s.body, inner, inner_ctx)
            self.stmts(s.else_, dict(env), {**ctx, "depth": ctx["depth"] + 1})
            return
        if s.else_ or s.test is not None or not isinstance(s.target, n.Name):
            raise _NotProven("a messages loop with else, a filter or a tuple target")
        if ctx["depth"] or ctx["msg_loop"] or ctx["macro"]:
            # inside a loop it would run more than once, inside a macro or {% set %} block its
            # text becomes a value (e.g. measured with | length): only at top level (or in an if)
            raise _NotProven("a messages loop inside a loop, a macro or a {% set %} block")
        if self.scan(s, env, ctx):
            return
        if self.main_loops:
            raise _NotProven("two messages loops write output")
        self.main_loops += 1
        inner = dict(env)
        self.targets(s.target, inner)
        self.stmts(s.body, inner, {**ctx, "loop": "loop", "msg_loop": True, "depth": ctx["depth"] + 1})
        self.after_main = True

    def scan(self, s: Any, env: dict[str, Any], ctx: dict[str, Any]) -> bool:
        """A last-index scan at top level: ``for m in messages: if P(m): set ns.x = loop.index0``."""
        n = self.n
        if len(s.body) != 1 or not isinstance(s.body[0], n.If):
            return False
        cond = s.body[0]
        if cond.elif_ or cond.else_ or len(cond.body) != 1 or not isinstance(cond.body[0], n.Assign):
            return False
        a = cond.body[0]
        if not (isinstance(a.target, n.NSRef) and isinstance(a.node, n.Getattr) and isinstance(a.node.node, n.Name)
                and a.node.node.name == "loop" and a.node.attr == "index0"):
            return False
        key = (a.target.name, a.target.attr)
        if env.get(a.target.name) != "ns" or self.ns_attrs.get(key) != "v":
            raise _NotProven("a last-index scan into an attribute already scanned or not a namespace")
        init = self.ns_init.get(key)
        if not self._const_le0(init):
            raise _NotProven(f"the scanned attribute {key[0]}.{key[1]} starts from a value other than a constant <= 0")
        names = {x.name for x in cond.test.find_all(n.Name)}
        if names - {s.target.name}:
            raise _NotProven(f"a scan predicate reading {sorted(names - {s.target.name})}")
        self.need_v(cond.test, {s.target.name: "v"}, {**ctx, "loop": None, "msg_loop": True, "depth": 1})
        self.ns_attrs[key] = "scan"
        self.scans.append((s.target.name, cond.test, False))
        return True

    def _last_index(self, e: Any) -> bool:
        """``e`` is ``messages | length - 1``."""
        n = self.n
        return (isinstance(e, n.Sub) and self._int_const(e.right) == 1 and isinstance(e.left, n.Filter)
                and e.left.name == "length" and not e.left.args and isinstance(e.left.node, n.Name)
                and e.left.node.name == "messages")

    def reverse_scan(self, s: Any, env: dict[str, Any]) -> bool:
        """The Qwen3 idiom, exactly::

            {% set ns = namespace(flag=true, x=messages | length - 1) %}
            {% for m in messages[::-1] %}{% set i = (messages | length - 1) - loop.index0 %}
              {% if ns.flag and P(m) %}{% set ns.flag = false %}{% set ns.x = i %}{% endif %}
            {% endfor %}

        ``ns.x``: the last index satisfying ``P`` (reading only ``m``), else the last index;
        ``ns.flag``: whether none does (a value)."""
        n = self.n
        if not isinstance(s.target, n.Name) or len(s.body) != 2:
            return False
        a, cond = s.body
        if not (isinstance(a, n.Assign) and isinstance(a.target, n.Name) and isinstance(a.node, n.Sub)
                and self._last_index(a.node.left) and isinstance(a.node.right, n.Getattr)
                and isinstance(a.node.right.node, n.Name) and a.node.right.node.name == "loop"
                and a.node.right.attr == "index0"):
            return False
        if not isinstance(cond, n.If) or cond.elif_ or cond.else_ or len(cond.body) != 2:
            return False
        terms: list[Any] = []
        t = cond.test
        while isinstance(t, n.And):
            terms.insert(0, t.right)
            t = t.left
        terms.insert(0, t)
        flag = terms[0]
        if not (len(terms) > 1 and isinstance(flag, n.Getattr) and isinstance(flag.node, n.Name)
                and env.get(flag.node.name) == "ns"):
            return False
        ns = flag.node.name
        sets = {}
        for x in cond.body:
            if not (isinstance(x, n.Assign) and isinstance(x.target, n.NSRef) and x.target.name == ns):
                return False
            sets[x.target.attr] = x.node
        attrs = [k for k in sets if k != flag.attr]
        if flag.attr not in sets or len(attrs) != 1:
            return False
        attr = attrs[0]
        if not (isinstance(sets[flag.attr], n.Const) and sets[flag.attr].value is False
                and isinstance(sets[attr], n.Name) and sets[attr].name == a.target.name):
            return False
        init_flag = self.ns_init.get((ns, flag.attr))
        if not (isinstance(init_flag, n.Const) and init_flag.value is True and self.ns_attrs.get((ns, flag.attr)) == "v"
                and self.ns_attrs.get((ns, attr)) == "pending"):
            return False
        pred: Any = terms[1]
        for x in terms[2:]:
            pred = n.And(pred, x)
        names = {x.name for x in pred.find_all(n.Name)}
        if names - {s.target.name}:
            raise _NotProven(f"a scan predicate reading {sorted(names - {s.target.name})}")
        self.need_v(pred, {s.target.name: "v"}, {"loop": None, "msg_loop": True, "macro": False, "depth": 1})
        self.ns_attrs[(ns, attr)] = "scan"
        self.ns_init[(ns, flag.attr)] = None  # assigned by the scan: a value, never a scan start
        self.scans.append((s.target.name, pred, True))
        return True

    def targets(self, t: Any, env: dict[str, Any]) -> None:
        n = self.n
        if isinstance(t, n.Name):
            self.bind(t.name, "v", env)
        elif isinstance(t, n.Tuple):
            for x in t.items:
                self.targets(x, env)
        else:
            raise _NotProven("a loop target that is not a name")

    # ---------------------------------------------------------------- expressions

    def need_v(self, e: Any, env: dict[str, Any], ctx: dict[str, Any]) -> None:
        k = self.kind(e, env, ctx)
        if k != "v":
            raise _NotProven(f"{type(e).__name__} of kind {k!r} used as a value")

    def _int_const(self, e: Any) -> int | None:
        n = self.n
        if isinstance(e, n.Const) and type(e.value) is int:
            return int(e.value)
        if isinstance(e, n.Neg) and isinstance(e.node, n.Const) and type(e.node.value) is int:
            return -int(e.node.value)
        return None

    def _const_le0(self, e: Any) -> bool:
        v = self._int_const(e) if e is not None else None
        return v is not None and v <= 0

    def _neighbour(self, e: Any, env: dict[str, Any], ctx: dict[str, Any]) -> int | None:
        """Distance ``k`` when ``e`` is ``loop.index0 +- k`` / ``loop.index +- k`` of a messages loop."""
        n = self.n
        off = 0
        if isinstance(e, (n.Add, n.Sub)):
            c = self._int_const(e.right)
            if c is None:
                return None
            off, e = (c if isinstance(e, n.Add) else -c), e.left
        if isinstance(e, n.Getattr) and isinstance(e.node, n.Name) and e.node.name == "loop" and ctx["loop"] == "loop" \
                and "loop" not in env and e.attr in ("index0", "index"):
            return abs(off + (e.attr == "index"))
        return None

    def kind(self, e: Any, env: dict[str, Any], ctx: dict[str, Any]) -> str:  # noqa: C901 - one case per node type
        n = self.n
        if isinstance(e, (n.Const, n.TemplateData)):
            return "v"
        if isinstance(e, n.Name):
            name = e.name
            if name in env:
                return env[name]
            if name == "messages":
                return "msgs"
            if ctx["macro"] and name in self.ns_names:
                raise _NotProven(f"the namespace {name!r} read inside a macro")
            if name == "loop":
                if ctx["loop"] is None:
                    raise _NotProven("'loop' outside a loop")
                return ctx["loop"]
            if name == "namespace":
                return "nsfunc"
            if name == "add_generation_prompt":
                if ctx["depth"] or ctx["macro"] or not self.after_main:
                    raise _NotProven("add_generation_prompt read before the main loop ends or inside a block")
                return "v"
            if name == "raise_exception" and not (ctx["depth"] or ctx["msg_loop"] or ctx["macro"]):
                return "v"  # at top level its condition is a value: it raises in the window iff in the full render
            if name in _IMPURE:
                raise _NotProven(f"the global {name!r}")
            return "v"
        if isinstance(e, n.Getattr):
            k = self.kind(e.node, env, ctx)
            if k == "v":
                return "v"
            if k == "loop":
                if e.attr in ("first", "last"):
                    return "v"
                if e.attr in ("index0", "index"):
                    return "idx"
                raise _NotProven(f"loop.{e.attr}")
            if k == "ns" and isinstance(e.node, n.Name):
                a = self.ns_attrs.get((e.node.name, e.attr))
                if a is None:
                    raise _NotProven(f"{e.node.name}.{e.attr} never set")
                return a
            raise _NotProven(f"an attribute of a {k}")
        if isinstance(e, n.Getitem):
            k = self.kind(e.node, env, ctx)
            if k == "msgs":
                c = self._int_const(e.arg)
                if c is not None and c >= 0:
                    self.const_max = max(self.const_max, c)
                    return "v"
                d = self._neighbour(e.arg, env, ctx)
                if d is None:
                    raise _NotProven("messages subscripted by something other than a constant >= 0 or loop.index0 +- k")
                self.radius = max(self.radius, d)
                return "v"
            if k != "v":
                raise _NotProven(f"a subscript of a {k}")
            if isinstance(e.arg, n.Slice):
                for part in (e.arg.start, e.arg.stop, e.arg.step):
                    if part is not None:
                        self.need_v(part, env, ctx)
            else:
                self.need_v(e.arg, env, ctx)
            return "v"
        if isinstance(e, n.Filter):
            if e.node is None:
                raise _NotProven("a filter block")
            k = self.kind(e.node, env, ctx)
            if k == "msgs" and e.name == "length" and not e.args and not e.kwargs:
                return "len"
            if k != "v" or e.name in ("random", "shuffle"):
                raise _NotProven(f"the filter {e.name!r} on a {k}")
            self.args(e, env, ctx)
            return "v"
        if isinstance(e, n.Test):
            self.need_v(e.node, env, ctx)
            self.args(e, env, ctx)
            return "v"
        if isinstance(e, n.Compare):
            parts = [e.expr] + [o.expr for o in e.ops]
            kinds = [self.kind(p, env, ctx) for p in parts]
            if all(k == "v" for k in kinds):
                return "v"
            ops = {o.op for o in e.ops}
            if not ops <= _CMP:
                raise _NotProven("an index or length in an 'in' test")
            if "len" in kinds:
                if len(parts) == 2 and kinds.count("len") == 1 and self._int_const(parts[1 - kinds.index("len")]) == 0:
                    return "v"
                raise _NotProven("messages | length compared with something other than 0")
            if "idx" not in kinds:
                raise _NotProven("a scanned index compared with something other than a loop index")
            for p, k in zip(parts, kinds):
                if k in ("idx", "scan"):
                    continue
                c = self._int_const(p)
                if c is None or (c > 0 and "scan" in kinds):
                    raise _NotProven("an index compared with something other than an index or an integer constant")
                self.const_max = max(self.const_max, c)  # the head keeps indices 0..c: same side of c
            return "v"
        if isinstance(e, (n.And, n.Or)):
            self.need_v(e.left, env, ctx)
            self.need_v(e.right, env, ctx)
            return "v"
        if isinstance(e, (n.Not, n.Neg, n.Pos)):
            self.need_v(e.node, env, ctx)
            return "v"
        if isinstance(e, n.BinExpr):
            self.need_v(e.left, env, ctx)
            self.need_v(e.right, env, ctx)
            return "v"
        if isinstance(e, n.Concat):
            for x in e.nodes:
                self.need_v(x, env, ctx)
            return "v"
        if isinstance(e, n.CondExpr):
            self.need_v(e.test, env, ctx)
            self.need_v(e.expr1, env, ctx)
            if e.expr2 is not None:
                self.need_v(e.expr2, env, ctx)
            return "v"
        if isinstance(e, (n.List, n.Tuple)):
            for x in e.items:
                self.need_v(x, env, ctx)
            return "v"
        if isinstance(e, n.Dict):
            for p in e.items:
                self.need_v(p.key, env, ctx)
                self.need_v(p.value, env, ctx)
            return "v"
        if isinstance(e, n.Call):
            k = self.kind(e.node, env, ctx)
            if k not in ("v", "macro"):
                raise _NotProven(f"a call of a {k}")
            self.args(e, env, ctx)
            return "v"
        raise _NotProven(f"the expression {type(e).__name__}")

    def args(self, e: Any, env: dict[str, Any], ctx: dict[str, Any]) -> None:
        for a in e.args:
            self.need_v(a, env, ctx)
        for kw in e.kwargs:
            self.need_v(kw.value, env, ctx)
        for d in (e.dyn_args, e.dyn_kwargs):
            if d is not None:
                self.need_v(d, env, ctx)
