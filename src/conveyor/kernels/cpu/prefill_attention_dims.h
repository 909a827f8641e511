/*
 * One body (BODY) per head dim for one element type: included by prefill_attention.c with
 * TIN, SUF, LOAD, START_TASK, FINISH_TASK and TILE_CHUNK defined; defines
 * prefill_<SUF>_d16, _d32, _d64, _d128 and _d256 (Gemma 2's head dim).
 */
#define CAT3_(a, b, c) a##b##c
#define CAT3(a, b, c) CAT3_(a, b, c)
#define D 16
#define NAME CAT3(prefill_, SUF, _d16)
#include BODY
#undef D
#undef NAME
#define D 32
#define NAME CAT3(prefill_, SUF, _d32)
#include BODY
#undef D
#undef NAME
#define D 64
#define NAME CAT3(prefill_, SUF, _d64)
#include BODY
#undef D
#undef NAME
#define D 128
#define NAME CAT3(prefill_, SUF, _d128)
#include BODY
#undef D
#undef NAME
#define D 256
#define NAME CAT3(prefill_, SUF, _d256)
#include BODY
#undef D
#undef NAME
#undef CAT3
#undef CAT3_
