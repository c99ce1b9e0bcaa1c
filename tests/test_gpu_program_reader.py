"""The GPU program's reader (:func:`adaloss_tools.gpu_program.read_hlo`) on hand-written optimized
HLO, one module per form it must count: a fusion whose result is a nested tuple, a bare copy,
a loop's body per iteration, reducers and comparators (no kernels of their own), and a line it
cannot read (an error, never a smaller count). No compiler needed."""
# ruff: noqa: E501 (HLO lines as the compiler prints them)

import pytest

from adaloss_tools import gpu_program as gp

_FUSED = """\
%fused_convert_reduce (p0: f32[4096,768]) -> ((f32[4096], f32[4096]), f16[4096,768]) {
  %p0 = f32[4096,768]{1,0} parameter(0)
  %convert = f16[4096,768]{1,0} convert(%p0)
  %zero = f32[] constant(0)
  %max = f32[4096]{0} reduce(%p0, %zero), dimensions={1}, to_apply=%maximum
  %sum = f32[4096]{0} reduce(%p0, %zero), dimensions={1}, to_apply=%add
  %stats = (f32[4096]{0}, f32[4096]{0}) tuple(%max, %sum)
  ROOT %out = ((f32[4096]{0}, f32[4096]{0}), f16[4096,768]{1,0}) tuple(%stats, %convert)
}

%maximum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
"""

NESTED = _FUSED + """
ENTRY %main (g: f32[4096,768]) -> ((f32[4096], f32[4096]), f16[4096,768], f32[]) {
  %g = f32[4096,768]{1,0} parameter(0)
  %fusion = ((f32[4096]{0}, f32[4096]{0}), f16[4096,768]{1,0}) fusion(%g), kind=kInput, calls=%fused_convert_reduce
  %stats = (f32[4096]{0}, f32[4096]{0}) get-tuple-element(%fusion), index=0
  %half = f16[4096,768]{1,0} get-tuple-element(%fusion), index=1
  %one = f32[] constant(1)
  %copy = f32[] copy(%one)
  ROOT %t = ((f32[4096]{0}, f32[4096]{0}), f16[4096,768]{1,0}, f32[]) tuple(%stats, %half, %copy)
}
"""

SORTED = """\
%compare (a: f32[], b: f32[]) -> pred[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

ENTRY %main (g: f32[1024]) -> f32[1024] {
  %g = f32[1024]{0} parameter(0)
  ROOT %sort = f32[1024]{0} sort(%g), dimensions={0}, to_apply=%compare
}
"""

LOOP = """\
%body (c: (s32[], f32[256])) -> (s32[], f32[256]) {
  %c = (s32[], f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %x = f32[256]{0} get-tuple-element(%c), index=1
  %y = f32[256]{0} copy(%x)
  ROOT %next = (s32[], f32[256]{0}) tuple(%i, %y)
}

%cond (c: (s32[], f32[256])) -> pred[] {
  %c = (s32[], f32[256]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: f32[256]) -> (s32[], f32[256]) {
  %x = f32[256]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[256]{0}) tuple(%zero, %x)
  ROOT %w = (s32[], f32[256]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}
}
"""


def test_a_fusion_with_a_nested_tuple_result_and_a_bare_copy_are_kernels_with_their_bytes():
    counts = gp.read_hlo(NESTED)
    assert counts["kernels"] == counts["kernels_run"] == 2
    fusion = 4096 * 768 * 4 + 2 * 4096 * 4 + 4096 * 768 * 2  # reads g; writes both statistics, g in fp16
    assert counts["kernel_bytes"] == counts["kernel_bytes_run"] == fusion + 4 + 4


def test_reducers_and_comparators_launch_nothing_of_their_own():
    counts = gp.read_hlo(SORTED)
    assert counts["kernels"] == 1 and counts["kernel_bytes"] == 2 * 1024 * 4


def test_a_loop_body_counts_once_per_iteration():
    counts = gp.read_hlo(LOOP)
    assert counts["kernels"] == 1 and counts["kernels_run"] == 10
    assert counts["kernel_bytes_run"] == 10 * 2 * 256 * 4


@pytest.mark.parametrize("line", [
    "  %f = ((f32[8]{0}, f32[8]{0}) fusion(%g), kind=kLoop, calls=%fused",  # unbalanced tuple
    "  %f = f32[8]{0} 42",                                                 # no opcode call
])
def test_an_instruction_the_reader_cannot_parse_is_an_error_not_a_smaller_count(line):
    text = NESTED.replace("  %one = f32[] constant(1)\n", f"  %one = f32[] constant(1)\n{line}\n")
    with pytest.raises(ValueError, match="cannot read this HLO instruction"):
        gp.read_hlo(text)


FRAMES = """\
FileNames
1 "jax_adaloss/backward.py"

FunctionNames
1 "_Sweep.merge"
2 "_stored"
3 "statistics"
4 "_Sweep._transpose"

FileLocations
1 {file_name_id=1 function_name_id=1 line=1 end_line=1 column=1 end_column=2}
2 {file_name_id=1 function_name_id=2 line=2 end_line=2 column=1 end_column=2}
3 {file_name_id=1 function_name_id=3 line=3 end_line=3 column=1 end_column=2}
4 {file_name_id=1 function_name_id=4 line=4 end_line=4 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=1}
4 {file_location_id=4 parent_frame_id=1}

"""

ATTRIBUTED = """\
%fused_stats (p0: f16[4096,768]) -> f32[4096] {
  %p0 = f16[4096,768]{1,0} parameter(0)
  %zero = f32[] constant(0)
  %wide = f32[4096,768]{1,0} convert(%p0), metadata={stack_frame_id=3}
  ROOT %max = f32[4096]{0} reduce(%wide, %zero), dimensions={1}, to_apply=%maximum, metadata={stack_frame_id=3}
}

%fused_sum (p0: f16[4096,768], p1: f16[4096,768]) -> f16[4096,768] {
  %p0 = f16[4096,768]{1,0} parameter(0)
  %p1 = f16[4096,768]{1,0} parameter(1)
  ROOT %sum = f16[4096,768]{1,0} add(%p0, %p1), metadata={stack_frame_id=2}
}

%fused_neg (p0: f16[4096,768]) -> f16[4096,768] {
  %p0 = f16[4096,768]{1,0} parameter(0)
  ROOT %neg = f16[4096,768]{1,0} negate(%p0), metadata={stack_frame_id=4}
}

%maximum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

ENTRY %main (g: f16[4096,768], h: f16[4096,768]) -> (f32[4096], f16[4096,768], f32[]) {
  %g = f16[4096,768]{1,0} parameter(0)
  %h = f16[4096,768]{1,0} parameter(1)
  %neg = f16[4096,768]{1,0} fusion(%g), kind=kLoop, calls=%fused_neg
  %stats = f32[4096]{0} fusion(%neg), kind=kInput, calls=%fused_stats
  %sum = f16[4096,768]{1,0} fusion(%neg, %h), kind=kLoop, calls=%fused_sum
  %one = f32[] constant(1)
  %copy = f32[] copy(%one)
  ROOT %t = (f32[4096]{0}, f16[4096,768]{1,0}, f32[]) tuple(%stats, %sum, %copy)
}
"""


def test_each_kernel_is_attributed_by_the_frames_of_what_it_writes_and_the_categories_sum_to_the_count():
    text = FRAMES + ATTRIBUTED
    got = gp.attribute(text)
    tensor = 4096 * 768 * 2
    assert got["model"] == {"kernels": 1, "bytes": 2 * tensor}  # the negation: _transpose
    assert got["statistics"] == {"kernels": 1, "bytes": tensor + 4096 * 4}  # statistics
    assert got["merges"] == {"kernels": 1, "bytes": 3 * tensor}  # _stored, called by merge
    assert got["scalars"] == {"kernels": 1, "bytes": 8}  # the copy
    assert got["rescales"] == {"kernels": 0, "bytes": 0}
    counts = gp.read_hlo(text)
    assert sum(c["kernels"] for c in got.values()) == counts["kernels_run"]
    assert sum(c["bytes"] for c in got.values()) == counts["kernel_bytes_run"]
