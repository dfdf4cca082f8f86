#include <cstdio>
int main() { std::puts("vireo"); return 0; }
