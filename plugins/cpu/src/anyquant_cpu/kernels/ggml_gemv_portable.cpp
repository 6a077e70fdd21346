// The portable build of ggml_gemv.cpp (the scalar paths alone, as any architecture other than x86-64 compiles it).
#define ANYQUANT_PORTABLE 1
#include "ggml_gemv.cpp"
