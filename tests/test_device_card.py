"""``wamkit.device.emulate_card`` (``wamkit bench train --device-memory``): a process on a large GPU
stands in for a smaller card, its CUDA context counted: plans read the card's size, the allocator gets
what the context leaves, and a card the device cannot stand in for is refused naming the sizes."""

from __future__ import annotations

import pytest
import torch

from wamkit.config import ConfigError


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_stood_in_card_counts_the_context_and_its_allocator_stops_at_the_rest():
    from wamkit.device import KERNEL_ALLOWANCE, device_budget, emulate_card

    dev = torch.device("cuda", 0)
    size = 4 * 10**9
    free, total = torch.cuda.mem_get_info(dev)
    try:
        cap = emulate_card(dev, size)
        assert device_budget(dev) == size  # what a memory plan reads
        assert cap <= size - (total - free) - KERNEL_ALLOWANCE + 2**20  # the context is outside the cap
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(cap + 64 * 2**20, dtype=torch.uint8, device=dev)
        x = torch.empty(cap // 2, dtype=torch.uint8, device=dev)  # well under it: allocated
        used = total - torch.cuda.mem_get_info(dev)[0]
        assert used <= size  # the driver's figure, context included, within the card
        del x
        with pytest.raises(ConfigError, match="cannot be stood in for"):
            emulate_card(dev, total + 2**30)
    finally:  # the rest of this process has the whole device again
        import wamkit.device

        wamkit.device._CARD_BYTES.clear()
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()
