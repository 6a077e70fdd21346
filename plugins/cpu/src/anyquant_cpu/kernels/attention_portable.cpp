// The portable build of attention.cpp (the scalar path alone, as any architecture other than x86-64 compiles it).
#define ANYQUANT_PORTABLE 1
#include "attention.cpp"
