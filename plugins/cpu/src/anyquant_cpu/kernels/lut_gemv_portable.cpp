// The portable build of lut_gemv.cpp (the scalar paths alone, as any architecture other than x86-64 compiles it).
#define ANYQUANT_PORTABLE 1
#include "lut_gemv.cpp"
