

def test_greedy_tokens_equal_torch_argmax_with_ties_to_the_lowest_id():
    """greedy_tokens (NumPy's argmax on CPU float32/64, torch's otherwise) against torch's
    argmax: rows of ties, a column view, one row, bfloat16 and float64."""
    import torch
    from specmoe.speculation.verify import greedy_tokens
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (5, 2, 300), generator=g).float()  # many ties per row
    x[2, 0, :] = 1.0                                           # a row of equal logits
    for t in (x[:, 0], x[:, 1], x[3, 0], x.double()[:, 0], x.bfloat16()[:, 0]):
        assert greedy_tokens(t) == t.argmax(-1).reshape(-1).tolist()
    assert greedy_tokens(x[2, 0]) == [0]
