"""The contracts: buf lint (STANDARD rules) passes, the generated stubs are those of the current
.proto files, the SamplingParams message matches the library's field for field, and library
errors map to the documented status codes and back."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import grpc
import pytest
from common.grpc_stubs.folio.v1 import common_pb2

from common.errors import InternalError, UnavailableError, error_for, status_code_for
from common.grpc_stubs import generate
from common.sampling_params import SamplingParams
from common.sampling_proto import sampling_params_from_proto, sampling_params_to_proto
from engine.errors import InvalidRequestError, QueueFullError

ROOT = Path(__file__).resolve().parents[2]
BUF = ROOT / ".tools" / "node_modules" / ".bin" / "buf"


def test_buf_lint_passes():
    assert BUF.is_file(), f"{BUF} is missing: the set-up (make) installs buf with npm"
    result = subprocess.run(
        [str(BUF), "lint"], cwd=ROOT / "protos", capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_stubs_match_the_protos(tmp_path):
    fresh = generate.generate(tmp_path)
    assert fresh, "no stubs generated"
    installed = generate.PACKAGE_DIR
    names = {p.relative_to(tmp_path) for p in fresh}
    present = {
        p.relative_to(installed)
        for p in (installed / generate.GENERATED).rglob("*.py*")
        if "__pycache__" not in p.parts
    }
    assert names == present, "stale stubs: run `make stubs`"
    for name in names:
        assert (installed / name).read_text() == (tmp_path / name).read_text(), (
            f"{name} differs from the .proto files: run `make stubs`"
        )


def test_sampling_params_message_matches_the_library():
    message_fields = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}
    assert message_fields == {f.name for f in dataclasses.fields(SamplingParams)}


def test_unset_sampling_params_take_the_library_defaults():
    assert sampling_params_from_proto(common_pb2.SamplingParams()) == SamplingParams()


def test_set_sampling_params_arrive_unchanged():
    expected = SamplingParams(
        temperature=0.0,
        top_p=0.5,
        top_k=7,
        min_p=0.1,
        repetition_penalty=1.2,
        presence_penalty=-0.5,
        frequency_penalty=0.25,
        logit_bias={3: -2.5, 9: 1.0},
        seed=0,
        max_tokens=9,
        min_tokens=2,
        stop_token_ids=[4, 5],
        ignore_eos=True,
        logprobs=0,
    )
    message = common_pb2.SamplingParams(**dataclasses.asdict(expected))
    assert sampling_params_from_proto(message) == expected


def test_token_limits_travel_both_ways():
    limited = SamplingParams(allowed_token_ids=[5, 2], bad_words_token_ids=[[7], [3, 4, 5]])
    wire = sampling_params_to_proto(limited)
    assert sampling_params_from_proto(wire) == limited
    # Unset on the wire: no limit (an empty allowed list would allow nothing).
    assert sampling_params_from_proto(sampling_params_to_proto(SamplingParams())) == (
        SamplingParams()
    )


@pytest.mark.parametrize(
    "error, code",
    [
        (InvalidRequestError("top_p must be in (0, 1]"), grpc.StatusCode.INVALID_ARGUMENT),
        (QueueFullError("the waiting queue is full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (UnavailableError("warming up"), grpc.StatusCode.UNAVAILABLE),
        (InternalError("boom"), grpc.StatusCode.INTERNAL),
    ],
)
def test_errors_map_to_status_codes_and_back(error, code):
    assert status_code_for(error) == code
    for wire in (code, code.value[0]):
        back = error_for(wire, str(error))
        assert type(back) is type(error) and str(back) == str(error)


def test_unexpected_errors_are_internal():
    assert status_code_for(RuntimeError("bug")) == grpc.StatusCode.INTERNAL
    # Only an InvalidRequestError says the request is at fault; a bare ValueError is a bug.
    assert status_code_for(ValueError("a bug")) == grpc.StatusCode.INTERNAL
