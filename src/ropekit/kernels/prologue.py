"""The prologue rope_kernel (.rope) and rope_norm_backward_kernel (.backward) share."""

import triton
import triton.language as tl  # noqa: F401  (the interpreter wants it in a jit function's module)

from ..language import split_token


@triton.jit
def token_prologue(t, S, positions, table, angle_strides, sections):
    """The prologue rope_kernel and rope_norm_backward_kernel share: token t (int64: a program id or
    a loop index) as (b, s), and the token's angle operands grouped as load_angles takes them.
    positions: (pos_ptr, stride_pos_row, stride_pos_batch, stride_pos_token); table: (cos_ptr,
    sin_ptr, sin_off, max_pos), sin at sin_ptr + sin_off; angle_strides: (stride_angle_row,
    stride_angle_batch, stride_angle_token, stride_angle_col); sections: (SEC_T, SEC_H, SEC_W,
    n_seqs, cp_size, cp_rank). Each kernel calls load_angles with them after issuing its head
    loads, so that the loads' latencies overlap with the dependent position -> table-row loads."""
    b, s = split_token(t, S)
    cos_ptr, sin_ptr, sin_off, max_pos = table
    return b, s, (positions, (cos_ptr, sin_ptr + sin_off, max_pos), angle_strides, sections)
