"""tools/fp4_order_search.py against the FP4 decode the GEMMs run (kernels/fp4_dequant.py): the byte order
the experts write is the one order where a code takes a single shift, and the PTX's lop3 tables and
immediates decode the codes of that order bit for bit (the PTX itself runs in tests/test_dequant_ptx.py)."""

import fp4_order_search as search  # tools/, on sys.path (conftest)
import pytest
import torch

fp4_dequant = pytest.importorskip("moe_registry_kernels.fp4_dequant")

ODD = (7, 0, 6, 5)  # the odd column's sign, e1, e0, m in a register-order byte
EVEN = (4, 3, 2, 1)


def test_the_only_single_shift_bfloat16_form_is_the_register_orders_odd_code():
    forms = list(search.search(max_shifts=1))
    assert [(f.positions, f.place, f.shifts) for f in forms] == [(ODD, 8, (-7, 0))]


def test_the_ptx_constants_decode_the_register_order():
    # odd pair: lop3(w >> 7, w, ODD_KEEP, 0x98); even pair: lop3(w >> 3, w << 3, MASK, 0xA8); w the placed word
    odd_keep, mask = int(fp4_dequant.E2M1_BF16_ODD_KEEP, 16), int(fp4_dequant.E2M1_BF16_MASK, 16)
    odd_table, even_table = fp4_dequant.LOP3_B_WHERE_C_ELSE_A_NOT_B.value, fp4_dequant.LOP3_OR_THEN_AND.value
    assert search.decodes(ODD, 8, (-7, 0), odd_table, odd_keep)
    assert search.decodes(EVEN, 8, (-3, 3), even_table, mask)
    assert not search.decodes(ODD, 8, (-7, 0), odd_table, mask)  # a wrong immediate is caught
    assert not search.decodes(EVEN, 8, (-3, 2), even_table, mask)  # and a wrong shift
    assert search.decode_form(EVEN, 8, (-3, 2)) is None


def test_the_register_order_puts_each_code_where_the_forms_read_it():
    packed = torch.arange(256, dtype=torch.uint8)
    ordered = fp4_dequant.e2m1_register_order(packed).to(torch.int64)
    for positions, codes in ((EVEN, packed.to(torch.int64) & 0xF), (ODD, packed.to(torch.int64) >> 4)):
        for field_bit, position in zip((3, 2, 1, 0), positions, strict=True):  # sign, e1, e0, m of a code
            assert torch.equal((ordered >> position) & 1, (codes >> field_bit) & 1)
