"""Backend choices measured on the machine at hand: the attention backend
(``attention``), the linear backend per weight shape (``linears``), the few-row GEMM split
(``few_rows``), their shared timing and on-disk cache (``cache``), and the one plan of
backends a runner asks for and applies (``plan``)."""
