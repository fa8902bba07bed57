"""``/api/v1/namespaces/{ns}/actions``: create, update, get, delete, list and invoke actions."""

from __future__ import annotations

import asyncio
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import structlog
from aiohttp import web

from dilu_invoker import jsonutil
from dilu_invoker.config import ApiConfig
from dilu_invoker.invoker.api import MSG_ABNORMAL_RUN, InvokerOverloaded, never_ran_for
from dilu_invoker.invoker.manifest import Manifest
from dilu_invoker.model import (
    DEFAULT_VERSION,
    Action,
    ActionLimits,
    Activation,
    ActivationRequest,
    ActivationResponse,
    ActivationStatus,
    Exec,
    GpuNeeds,
    JsonValue,
    LimitBounds,
    Parameter,
    ValidationError,
    bump_version,
    json_size,
    merge_params,
    new_activation_id,
    now_ms,
    parse_key_values,
)
from dilu_invoker.openwhisk.rest_common import (
    CONFIG,
    MANIFEST,
    RUNNER,
    STORE,
    TASKS,
    TRANSID,
    ApiError,
    Msg,
    authenticate,
    check_entity_name,
    json_response,
    parse_json_body,
    query_bool,
    query_limit,
    query_skip,
    read_body,
    resolve_namespace,
)
from dilu_invoker.store import STORE_UNAVAILABLE, RevisionConflict, action_summary_json

log = structlog.get_logger(__name__)

MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ActionFit:
    """What this system can ever run (standalone knows it): an action whose own limits exceed it is refused
    at PUT with 400 and the reason, instead of being stored and then never running."""

    user_memory_mb: int
    """The largest invoker user memory (``--invoker-user-memory-mb``)."""
    gpu_memory_mb: int | None = None
    """Memory of the largest GPU; None: no GPU (GPU kinds then run on the CPU, nothing to judge)."""
    gpu_name: str = ""
    invoker_gpus: int | None = None
    """The most GPUs one invoker has, all a gang (``gpu-count``) may take; None: not judged."""
    gangs: bool = True
    """Whether the balancer places instances here (balancer routing): a gang runs nowhere else."""

    def refusal(self, action: Action, *, gpu: bool) -> str | None:
        mem = action.limits.memory_mb
        if mem > self.user_memory_mb:
            return (f"The action's memory limit of {mem} MB exceeds the invoker user memory of "
                    f"{self.user_memory_mb} MB: it could never run.")
        if gpu:
            gangs = self._gang_refusal(action)
            if gangs is not None:
                return gangs
        if gpu and self.gpu_memory_mb is not None:
            needs = GpuNeeds.from_annotations(action.annotation_map)
            if needs.memory_mb > self.gpu_memory_mb:
                return (f"Annotation 'gpu-memory-mb' of {needs.memory_mb} MB exceeds the largest GPU here "
                        f"({self.gpu_memory_mb} MB{', ' + self.gpu_name if self.gpu_name else ''}): "
                        "it could never be placed.")
        return None

    def _gang_refusal(self, action: Action) -> str | None:
        gpus = GpuNeeds.gpus_of(action.annotation_map)
        if gpus <= 1:
            return None
        if not self.gangs:
            return (f"Annotation 'gpu-count' of {gpus} makes each instance a gang of {gpus} GPUs, which only the "
                    "balancer places, and this system runs without balancer routing (--no-balancer-routing): "
                    "it could never run.")
        if self.invoker_gpus is not None and gpus > self.invoker_gpus:
            return (f"Annotation 'gpu-count' of {gpus} exceeds the GPUs of any invoker here ({self.invoker_gpus}): "
                    "a gang's GPUs are all on one invoker, so it could never be placed.")
        return None


ACTION_FIT: web.AppKey[ActionFit] = web.AppKey("action_fit", ActionFit)


class ActionListener(Protocol):
    """Told of every action this API stored or deleted, after the store has it (standalone's model
    pre-loading, `dataplane.model_preload.ModelPreloads`); it must not block nor raise."""

    def stored(self, action: Action) -> None: ...

    def deleted(self, action: Action) -> None: ...


ACTION_LISTENER: web.AppKey[ActionListener] = web.AppKey("action_listener", ActionListener)


def _tell(app: web.Application, event: str, action: Action) -> None:
    listener = app.get(ACTION_LISTENER)
    if listener is None:
        return
    try:
        getattr(listener, event)(action)
    except Exception:  # a listener never fails the request that changed the action
        log.exception("action listener failed", action=action.fqn, event=event)


_SEMVER_RE = re.compile(r"\A\d+\.\d+\.\d+\Z")
#: JSON framing around code and parameters in a PUT body that the size limits do not count
_PUT_SLACK = 64 * 1024
ACTIVATION_ID_HEADER = "x-openwhisk-activation-id"
#: failures before an activation ran that the caller is told to retry (503)
_OVERLOAD: tuple[type[Exception], ...] = (InvokerOverloaded, *STORE_UNAVAILABLE)


def put_body_limit(cfg: ApiConfig) -> int:
    # code, parameters and annotations may each be at their limit
    return cfg.max_code_mb * MB + 2 * cfg.max_params_kb * 1024 + _PUT_SLACK


def invoke_body_limit(cfg: ApiConfig) -> int:
    return cfg.max_params_kb * 1024


# --------------------------------------------------------------------------------------------
# PUT content → Action
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ActionPut:
    """A validated PUT body; ``None`` fields keep the stored action's value on update."""

    exec: Exec | None = None
    parameters: tuple[Parameter, ...] | None = None
    annotations: tuple[Parameter, ...] | None = None
    limits: Mapping[str, Any] | None = None
    version: str | None = None
    publish: bool | None = None


def _malformed(detail: str) -> ApiError:
    return ApiError(400, f"The request content was malformed: {detail}")


async def parse_action_put(content: JsonValue, *, cfg: ApiConfig, manifest: Manifest) -> ActionPut:
    if content is None:
        content = {}
    if not isinstance(content, dict):
        raise _malformed("expected a JSON object.")
    try:
        exec_ = await _parse_exec(content.get("exec"), cfg=cfg, manifest=manifest)
        parameters = _sized_key_values(content.get("parameters"), "parameters", cfg)
        annotations = _sized_key_values(content.get("annotations"), "annotations", cfg)
        limits = content.get("limits")
        if limits is not None:
            if not isinstance(limits, dict):
                raise _malformed("'limits' must be an object.")
            ActionLimits.from_json(limits, bounds=LimitBounds())  # reject out-of-bound values now
        version = content.get("version")
        if version is not None and (not isinstance(version, str) or not _SEMVER_RE.match(version)):
            raise _malformed("'version' must be a semantic version such as 0.0.1.")
        publish = content.get("publish")
        if publish is not None and not isinstance(publish, bool):
            raise _malformed("'publish' must be a boolean.")
    except ValidationError as exc:
        raise ApiError(400, str(exc)) from None
    return ActionPut(exec=exec_, parameters=parameters, annotations=annotations, limits=limits,
                     version=version, publish=publish)


async def _parse_exec(obj: JsonValue, *, cfg: ApiConfig, manifest: Manifest) -> Exec | None:
    if obj is None:
        return None
    exec_ = Exec.from_json(obj)
    runtime = manifest.resolve(exec_.kind)
    if runtime is None:
        raise ApiError(400, manifest.unsupported_message(exec_.kind))
    if runtime.deprecated:
        raise ApiError(400, Msg.runtime_deprecated(runtime.kind))
    if exec_.code is None:
        raise _malformed(f"'code' must be a string defined in 'exec' for '{runtime.kind}' actions.")
    if runtime.require_main and not exec_.main:
        raise _malformed(f"'main' must be a string defined in 'exec' for '{runtime.kind}' actions.")
    size = len(exec_.code.encode())
    allowed = cfg.max_code_mb * MB
    if size > allowed:
        raise ApiError(413, Msg.too_big("exec", size, allowed))
    if exec_.binary and isinstance(obj, dict) and obj.get("binary") is True and not await _is_base64(exec_.code):
        raise _malformed("exec 'binary' is true but 'code' is not base64.")
    return replace(exec_, kind=runtime.kind)


async def _is_base64(code: str) -> bool:
    def check() -> bool:
        try:
            binascii.a2b_base64("".join(code.split()), strict_mode=True)
            return True
        except (binascii.Error, ValueError):
            return False

    return await asyncio.to_thread(check) if len(code) > jsonutil.OFFLOAD_BYTES else check()


def _sized_key_values(obj: JsonValue, field: str, cfg: ApiConfig) -> tuple[Parameter, ...] | None:
    if obj is None:
        return None
    values = parse_key_values(obj, field)
    size = json_size([p.to_json() for p in values])
    allowed = cfg.max_params_kb * 1024
    if size > allowed:
        raise ApiError(413, Msg.too_big(field, size, allowed))
    return values


def _with_annotation(annotations: tuple[Parameter, ...], key: str, value: JsonValue) -> tuple[Parameter, ...]:
    return (*(a for a in annotations if a.key != key), Parameter(key, value))


def merge_action(put: ActionPut, *, namespace: str, name: str, existing: Action | None,
                 manifest: Manifest) -> Action:
    """OpenWhisk's ``make`` (create) and ``updateWhiskAction`` (overwrite) rules."""
    bounds = LimitBounds()
    try:
        if existing is None:
            if put.exec is None:
                raise ApiError(400, Msg.EXEC_UNDEFINED)
            annotations = put.annotations or ()
            # OpenWhisk's require-api-key-annotation feature: new actions get no API key unless asked.
            if not any(a.key == "provide-api-key" for a in annotations):
                annotations = (*annotations, Parameter("provide-api-key", False))
            action = Action(
                namespace=namespace, name=name, exec=put.exec,
                limits=ActionLimits.from_json(put.limits, bounds=bounds),
                parameters=put.parameters or (),
                annotations=annotations,
                version=put.version or DEFAULT_VERSION,
                publish=bool(put.publish),
            )
        else:
            annotations = put.annotations if put.annotations is not None else existing.annotations
            kept = existing.annotation("provide-api-key")
            if kept is not None and not any(a.key == "provide-api-key" for a in annotations):
                annotations = (*annotations, Parameter("provide-api-key", kept))
            action = Action(
                namespace=namespace, name=name, exec=put.exec or existing.exec,
                limits=ActionLimits.from_json(put.limits, bounds=bounds, base=existing.limits),
                parameters=put.parameters if put.parameters is not None else existing.parameters,
                annotations=annotations,
                version=put.version or bump_version(existing.version),
                publish=put.publish if put.publish is not None else existing.publish,
                revision=existing.revision,
            )
        action = replace(action, annotations=_with_annotation(action.annotations, "exec", action.exec.kind),
                         updated=now_ms())
        runtime = manifest.resolve(action.exec.kind)
        if runtime is not None and runtime.gpu:
            GpuNeeds.from_annotations(action.annotation_map)
    except ValidationError as exc:
        raise ApiError(400, str(exc)) from None
    return action


# --------------------------------------------------------------------------------------------
# Handlers: CRUD
# --------------------------------------------------------------------------------------------


def _target(request: web.Request) -> tuple[str, str]:
    identity = authenticate(request)
    name = check_entity_name(request.match_info["name"])
    ns = resolve_namespace(identity, request.match_info["namespace"], f"actions/{name}")
    return ns, name


async def _action_response(action: Action, *, code: bool = True) -> web.Response:
    body = action.to_json()
    if not code:
        body["exec"] = replace(action.exec, code=None).to_json()
    size = len(action.exec.code or "") if code else 0
    return json_response(None, encoded=await jsonutil.adumps(body, size_hint=size))


async def put_action(request: web.Request) -> web.Response:
    ns, name = _target(request)
    app = request.app
    cfg = app[CONFIG]
    overwrite = query_bool(request, "overwrite")
    content = await parse_json_body(await read_body(request, put_body_limit(cfg)))
    put = await parse_action_put(content, cfg=cfg, manifest=app[MANIFEST])
    store = app[STORE]
    existing = await store.get_action(ns, name)
    if existing is not None and not overwrite:
        raise ApiError(409, Msg.EXISTS)
    action = merge_action(put, namespace=ns, name=name, existing=existing, manifest=app[MANIFEST])
    fit = app.get(ACTION_FIT)
    if fit is not None:
        runtime = app[MANIFEST].resolve(action.exec.kind)
        refusal = fit.refusal(action, gpu=runtime is not None and runtime.gpu)
        if refusal:
            raise ApiError(400, refusal)
    try:
        stored = await store.put_action(action, expected_revision=existing.revision if existing else None)
    except RevisionConflict:
        raise ApiError(409, Msg.CONFLICT) from None
    log.info("action stored", action=stored.fqn, revision=stored.revision, kind=stored.exec.kind)
    _tell(app, "stored", stored)
    return await _action_response(stored)


async def get_action(request: web.Request) -> web.Response:
    ns, name = _target(request)
    code = query_bool(request, "code", True)
    action = await request.app[STORE].get_action(ns, name)
    if action is None:
        raise ApiError(404, Msg.NOT_FOUND)
    return await _action_response(action, code=code)


async def delete_action(request: web.Request) -> web.Response:
    ns, name = _target(request)
    action = await request.app[STORE].delete_action(ns, name)
    if action is None:
        raise ApiError(404, Msg.NOT_FOUND)
    log.info("action deleted", action=action.fqn)
    _tell(request.app, "deleted", action)
    return await _action_response(action)


async def list_actions(request: web.Request) -> web.Response:
    identity = authenticate(request)
    ns = resolve_namespace(identity, request.match_info["namespace"], "actions")
    skip = query_skip(request, "actions")
    limit = query_limit(request, "actions")
    store = request.app[STORE]
    if query_bool(request, "count"):
        return json_response({"actions": await store.count_actions(ns, skip=skip)})
    actions = await store.list_actions(ns, skip=skip, limit=limit)
    return json_response([action_summary_json(a) for a in actions])


# --------------------------------------------------------------------------------------------
# Invoke
# --------------------------------------------------------------------------------------------


class _Invocation:
    """One activation run on behalf of a request. Once the request has been answered without the result
    (non-blocking, or the blocking wait ran out) the invocation is *detached*: from then on nothing can be
    reported to the caller, so every outcome, an overload included, ends as a stored activation record."""

    def __init__(self, app: web.Application, req: ActivationRequest) -> None:
        self.app = app
        self.req = req
        self.detached = False
        #: the activation, once it ran: a blocking caller is answered from it while the record is written
        #: (as OpenWhisk answers from the invoker's result ack); reads of the record see it meanwhile
        self.ran: asyncio.Future[Activation] = asyncio.get_running_loop().create_future()
        #: done once the caller's answer is built (or the caller is gone): the record's write waits for it,
        #: so encoding and writing the record is not on a blocking caller's path
        self.answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def answer_built(self) -> None:
        if not self.answered.done():
            self.answered.set_result(None)

    async def run(self) -> Activation:
        req = self.req
        try:
            activation = await self.app[RUNNER].run(req)
        except _OVERLOAD:
            # Redis unavailable to the invoker's routing counts as overload: answered 503 (retry).
            if not self.detached:
                raise
            activation = fallback_activation(req, ActivationResponse.whisk_error(Msg.OVERLOADED))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the activation runner failed", activation_id=req.activation_id)
            activation = fallback_activation(req, ActivationResponse.whisk_error(MSG_ABNORMAL_RUN))
        if not req.identity.store_activations:
            self.ran.set_result(activation)
            return activation
        # The waiter wakes on the loop's next turn; by then the write below has begun, so the record is
        # readable (store_activation registers it before its first await) when the caller is told.
        self.ran.set_result(activation)
        try:
            await self.app[STORE].store_activation(activation, after=None if self.detached else self.answered)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("storing the activation failed", activation_id=req.activation_id)
        return activation


def fallback_activation(req: ActivationRequest, response: ActivationResponse) -> Activation:
    """The record of an activation that never ran (OpenWhisk's invoker writes the same shape)."""
    return never_ran_for(req, response)


def _blocking_wait_s(request: web.Request, cfg: ApiConfig) -> float:
    max_ms = int(cfg.blocking_wait_s * 1000)
    raw = request.query.get("timeout")
    if raw is None:
        return cfg.blocking_wait_s
    try:
        ms = int(raw)
    except ValueError:
        raise ApiError(400, Msg.invalid_timeout(max_ms)) from None
    if not 0 < ms <= max_ms:
        raise ApiError(400, Msg.invalid_timeout(max_ms))
    return ms / 1000.0


def _content(action: Action, payload: JsonValue) -> tuple[dict[str, JsonValue] | list[JsonValue], tuple[str, ...]]:
    if payload is None:
        payload = {}
    if isinstance(payload, list):
        return payload, ()
    if not isinstance(payload, dict):
        raise _malformed("the invoke payload must be a JSON object.")
    if action.annotation("final") is True:
        fixed = {p.key for p in action.parameters if p.value is not None}
        if fixed & payload.keys():
            raise ApiError(400, Msg.PARAMETERS_NOT_ALLOWED)
    return merge_params(action.default_params, payload), action.init_param_names


async def invoke_action(request: web.Request) -> web.Response:
    identity = authenticate(request)
    name = check_entity_name(request.match_info["name"])
    ns = resolve_namespace(identity, request.match_info["namespace"], f"actions/{name}")
    app = request.app
    cfg = app[CONFIG]
    blocking = query_bool(request, "blocking")
    result_only = query_bool(request, "result")
    wait_s = _blocking_wait_s(request, cfg)
    payload = await parse_json_body(await read_body(request, invoke_body_limit(cfg)))
    action = await app[STORE].get_action(ns, name)
    if action is None:
        raise ApiError(404, Msg.NOT_FOUND)
    runtime = app[MANIFEST].resolve(action.exec.kind)
    if runtime is None:
        raise ApiError(400, app[MANIFEST].unsupported_message(action.exec.kind))
    if runtime.deprecated:
        raise ApiError(400, Msg.runtime_deprecated(runtime.kind))
    content, init_args = _content(action, payload)
    req = ActivationRequest(
        activation_id=new_activation_id(),
        action=action,
        identity=identity,
        content=content,
        transid=list(TRANSID.get()),
        init_args=init_args,
        blocking=blocking,
    )
    invocation = _Invocation(app, req)
    task = asyncio.create_task(invocation.run(), name=f"activation-{req.activation_id}")
    tasks = app[TASKS]
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    headers = {ACTIVATION_ID_HEADER: req.activation_id}
    accepted = json_response({"activationId": req.activation_id}, status=202, headers=headers)

    try:
        if not blocking:
            # One turn of the loop lets the runner refuse at once (queue full) so the caller gets 503, not
            # an id that will only ever show an overload record.
            await asyncio.sleep(0)
            if task.done() and isinstance(task.exception(), _OVERLOAD):
                raise ApiError(503, Msg.OVERLOADED)
            invocation.detached = True
            return accepted

        done, _ = await asyncio.wait({task, invocation.ran}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            invocation.detached = True
            log.info("blocking invoke answered 202 after the wait", activation_id=req.activation_id, wait_s=wait_s)
            return accepted
        try:
            activation = invocation.ran.result() if invocation.ran.done() else task.result()
        except InvokerOverloaded:
            raise ApiError(503, Msg.OVERLOADED) from None
        return await _activation_result_response(activation, result_only=result_only, headers=headers)
    finally:
        # The record's write begins on a later turn of the loop, after this answer has been written out.
        invocation.answer_built()


_HTTP_STATUS = {
    ActivationStatus.SUCCESS: 200,
    # OpenWhisk answers 502 for application and developer errors and 500 for its own.
    ActivationStatus.APPLICATION_ERROR: 502,
    ActivationStatus.DEVELOPER_ERROR: 502,
    ActivationStatus.WHISK_ERROR: 500,
}


async def _activation_result_response(
    activation: Activation, *, result_only: bool, headers: Mapping[str, str]
) -> web.Response:
    status = _HTTP_STATUS[activation.response.status]
    if result_only:
        result = activation.response.result
        body: JsonValue = {} if result is None else result
        size_hint = activation.response.size or 0
    else:
        body = activation.to_api_json()
        size_hint = sum(len(line) for line in activation.logs) + (activation.response.size or 0)
    return json_response(None, status=status, headers=headers,
                         encoded=await jsonutil.adumps(body, size_hint=size_hint))
