// A launch's small per-call tables, by value in its parameters (avpipe.device.cuda_modules:
// launch_table, table_args). The loader prepends this to a module's source where asked
// (table=True) and puts TABLE_BYTES // 8 in place of @WORDS@.
#ifndef AVP_TABLE_DEFINED
#define AVP_TABLE_DEFINED
#define AVP_TABLE_WORDS @WORDS@
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
#define AVP_GRID_CONST __grid_constant__
#else
#define AVP_GRID_CONST
#endif
// a launch's small tables, by value (cuda_modules.TABLE_BYTES)
struct AvpTable { long long w[AVP_TABLE_WORDS]; };
// p: a device address, or with inl set a byte offset into the launch's table (never 0). A
// GPU before 7.0 never gets a table (launch_table says no there), and reading one would copy
// it to every thread's memory: there p is always an address.
template <typename T>
__device__ __forceinline__ const T* avp_tab(const AvpTable& tab, int inl, const T* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
    return p;
#else
    return inl ? (const T*)((const char*)tab.w + (unsigned long long)p) : p;
#endif
}
#endif
